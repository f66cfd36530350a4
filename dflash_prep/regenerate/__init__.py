"""Optional stage 1a: have the target model rewrite a corpus's assistant turns (resumable, engine-agnostic)."""

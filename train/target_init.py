"""A tiny Qwen3 target, built offline: a byte-level BPE tokenizer with a ChatML template and a
randomly initialised ``Qwen3ForCausalLM``, both saved with ``save_pretrained`` into one folder.

It is what the DFlash demo trains as an LM and then drafts for, and what the tests use as a
real transformers model (``transformers serve`` loads it, ``AutoTokenizer`` renders its
template). Nothing is downloaded: the tokenizer is trained with ``tokenizers`` on the given
texts (by default the synth corpus's text pool) in a few seconds.

    python -m dflash_prep.train.target_init --out demo/target [--hidden 128 --layers 4]

The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` (its ``chat_template`` is :data:`CHAT_TEMPLATE`)
and ``special_tokens_map.json``. The same arguments give the same bytes (seeded init).
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dflash_prep.synth.synth import _pool

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
"""Special tokens, ids 0..3. ``<|mask|>`` is never produced by the template: a DFlash drafter
uses it as its mask token."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML with ``{% generation %}`` around each assistant answer and its ``<|im_end|>``."""


@dataclass(frozen=True)
class TargetSpec:
    """Shape of the tiny target."""

    vocab_size: int = 2048
    """BPE vocabulary, specials included (the trainer may stop short of it on little text)."""
    hidden: int = 128
    """d_model."""
    layers: int = 4
    """Decoder layers (a DFlash drafter taps some of them)."""
    heads: int = 4
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (GQA)."""
    head_dim: int = 32
    """Per-head dimension."""
    intermediate: int = 384
    """SwiGLU width."""
    max_position: int = 4096
    """RoPE table length (max_position_embeddings)."""
    seed: int = 0
    """Weight init seed."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
                     "max_position"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TargetSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab_size <= len(SPECIALS) + 256:
            raise ValueError(f"vocab_size must exceed {len(SPECIALS) + 256} (specials + byte alphabet)")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer) trained on ``texts``, as a transformers
    ``PreTrainedTokenizerFast`` with :data:`CHAT_TEMPLATE`, eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, bos_token=None)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|mask|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def default_texts(chars: int = 400_000) -> list[str]:
    """The synth corpus's text pool, cut in 1,000-character pieces (what the demo trains on)."""
    text = _pool(1)[:chars]
    return [text[i:i + 1000] for i in range(0, len(text), 1000)]


def build_target(out: Path | str, spec: TargetSpec = TargetSpec(), texts: Iterable[str] | None = None) -> Path:
    """Write a tokenizer + random ``Qwen3ForCausalLM`` folder at ``out`` and return its path.

    ``out`` must not exist or be empty: nothing of the user's is overwritten.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty folder; pass a new --out")
    tok = train_tokenizer(default_texts() if texts is None else texts, spec.vocab_size)
    config = Qwen3Config(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_theta=10000.0, torch_dtype="float32")
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=False)
    tmp = out.with_name(f".{out.name}.tmp-target")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.train.target_init",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="new folder to write")
    for f in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "seed"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(TargetSpec, f))
    a = ap.parse_args(argv)
    spec = TargetSpec(**{f: getattr(a, f) for f in ("vocab_size", "hidden", "layers", "heads", "kv_heads",
                                                    "head_dim", "intermediate", "seed")})
    try:
        path = build_target(a.out, spec)
    except (FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"target: {path} ({spec.layers} layers, d_model {spec.hidden}, vocab {spec.vocab_size})")


if __name__ == "__main__":
    main()

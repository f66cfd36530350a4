"""Training prompts that ship with the package: maths (GSM8K train), code and chat (GPTeacher), MIT.

Prompts only: the target writes the answers (``dflash-prep prompts --set all --out prompts.jsonl``,
then ``dflash-prep regenerate prompts.jsonl ...``). Each set is a small gzip JSON-lines file under
``data/``, a deterministic subset of its public source at a recorded commit, with none of its
records equal to, containing or sharing a 13-word run with a shipped evaluation prompt
(:mod:`.overlap`). ``manifest.json`` records the source, licence, attribution, counts and hashes;
``NOTICE`` keeps the licence texts. :mod:`.sets` reads and exports them, :mod:`.build` remakes them,
:mod:`.sources` says where each comes from; docs/training-prompts.md has the table and the rule.
"""

from dflash_prep.trainsets.sets import describe, export, load_set, parse_sets, sample_set, set_names

__all__ = ["describe", "export", "load_set", "parse_sets", "sample_set", "set_names"]

"""The mask token of a DFlash (DFlash2) drafter: one id per run, decided once, never in the data.

A drafter fills every slot of a block but the first with the mask token (:mod:`.batch`); an id
that also occurs in the data would make a masked slot and a real token alike, so
:func:`~.batch.build_dflash_batch` refuses data that holds it. :func:`choose_mask_token` decides,
first rule that applies:

1. ``--mask-token-id ID``;
2. the id the run's checkpoint recorded (``OUT/checkpoint.pt``, its run contract's
   ``mask_token_id``): a resumed run keeps its id, whatever the rules below would pick now;
3. the tokenizer's mask token, else a token named ``<|mask|>``;
4. the first embedding row past the tokenizer (an id no text maps to);
5. the lowest-id *unused special token*: the tokenizer's special tokens (``all_special_ids`` and
   the ``added_tokens_decoder`` entries marked special), less bos, eos, pad and unk (the
   tokenizer's and the target config's) and every id the chat template emits on a sample
   conversation (:data:`SAMPLE_CHAT`, rendered with and without its system turn and generation
   prompt), whose count in the dataset is 0.

The counts are :func:`dflash_prep.formats.token_counts.id_counts`: every id at every position of
every sample (the batch refusal looks at all of them, not only the labels), counted once and kept
beside the dataset as ``DATA/id_counts.npy``. Where the dataset folder is at hand, the id of rules
1 and 3 is checked against them too, and one that occurs is refused in one line with its count.
Without a folder (in-memory data) rule 5 picks unchecked and the batch refusal is the check.
No eligible id: one line that says to pass ``--mask-token-id``.

The chosen id is recorded in the run contract and the drafter config of each checkpoint, the
export writes it to ``config.json``'s ``dflash_config.mask_token_id`` (what vLLM reads), and a
split job's target ranks decide from the same files, so every side agrees.
:meth:`MaskChoice.line` is what the trainer prints: the id, its token and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_prep.errors import ConfigError
from dflash_prep.formats.token_counts import id_counts

SAMPLE_CHAT = ({"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "What is 2 + 2?"},
               {"role": "assistant", "content": "4."},
               {"role": "user", "content": "And 3 + 3?"},
               {"role": "assistant", "content": "6."})
"""The conversation whose rendering names the chat template's own tokens (never mask candidates)."""


@dataclass(frozen=True)
class MaskChoice:
    """The run's mask token and why it is that one."""

    id: int
    token: str | None
    """Its string in the tokenizer (None: an embedding row past the tokenizer)."""
    why: str
    checked: str
    """What the data says about it ("0 of N tokens in DATA"), or why it was not checked."""

    def line(self) -> str:
        name = f" {self.token!r}" if self.token is not None else ""
        return f"mask token: id {self.id}{name} ({self.why}, {self.checked})"


def choose_mask_token(tokenizer, vocab_size: int, requested: int | None = None, *, data: str | Path | None = None,
                      recorded: tuple[int, str] | None = None, reserved=()) -> MaskChoice:
    """The mask token of the module docstring's rules over ``vocab_size`` embedding rows.
    ``data``: the dataset folder (None: not at hand); ``recorded``: ``(id, where)`` a checkpoint
    recorded; ``reserved``: ids never to choose besides the tokenizer's own bos/eos/pad/unk (the
    target config's)."""
    if requested is not None:
        return _checked(tokenizer, vocab_size, int(requested), "--mask-token-id", data,
                        "pass a --mask-token-id that never occurs there, or leave it unset to have one chosen")
    if recorded is not None:
        mid, where = int(recorded[0]), recorded[1]
        if not 0 <= mid < vocab_size:
            raise ConfigError(f"the mask token id {mid} recorded in {where} is outside the target's embedding rows "
                              f"(0..{vocab_size - 1}); resume with the run's target, or pass --from-scratch")
        return MaskChoice(mid, _token(tokenizer, mid), f"recorded in {where}", "not decided again")
    fix = "pass --mask-token-id with an id that never occurs there"
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return _checked(tokenizer, vocab_size, int(tokenizer.mask_token_id), "the tokenizer's mask token", data, fix)
    if "<|mask|>" in tokenizer.get_vocab():
        return _checked(tokenizer, vocab_size, int(tokenizer.convert_tokens_to_ids("<|mask|>")),
                        "the tokenizer's <|mask|> token", data, fix)
    if len(tokenizer) < vocab_size:
        return MaskChoice(len(tokenizer), None, "the first embedding row past the tokenizer",
                          "no text maps to it")
    return _unused_special(tokenizer, vocab_size, data, reserved)


def _token(tokenizer, mid: int) -> str | None:
    return tokenizer.convert_ids_to_tokens(mid) if 0 <= mid < len(tokenizer) else None


def _counts(data):
    return None if data is None else id_counts(data)


def _seen(counts, mid: int, data) -> str:
    if counts is None:
        return "not checked: no dataset folder"
    return f"{counts.of(mid)} of {counts.total} tokens in {data}"


def _checked(tokenizer, vocab_size: int, mid: int, why: str, data, fix: str) -> MaskChoice:
    """``mid`` after the range check and, with ``data``, the count check (module docstring)."""
    if not 0 <= mid < vocab_size:
        raise ConfigError(f"{why} {mid} is outside the target's embedding rows (0..{vocab_size - 1})")
    counts, tok = _counts(data), _token(tokenizer, mid)
    name = f" {tok!r}" if tok is not None else ""
    if counts is not None and counts.of(mid):
        raise ConfigError(f"{why} {mid}{name} occurs {counts.of(mid)} times in {data} (of {counts.total} tokens); "
                          f"the mask token must never occur in the data: {fix}")
    return MaskChoice(mid, tok, why, _seen(counts, mid, data))


def _unused_special(tokenizer, vocab_size: int, data, reserved) -> MaskChoice:
    """Rule 5 of the module docstring."""
    candidates = special_candidates(tokenizer, vocab_size, reserved)
    counts = _counts(data)
    free = [i for i in candidates if counts is None or counts.of(i) == 0]
    if not free:
        seen = ", ".join(f"{i} {_token(tokenizer, i)!r} x{counts.of(i)}" for i in candidates[:6]) \
            if candidates and counts is not None else "none outside the chat template and bos/eos/pad/unk"
        raise ConfigError(f"the target's tokenizer has no mask token, no spare embedding row and no special token "
                          f"unused in {data if data is not None else 'the data'} (candidates: {seen}); pass "
                          "--mask-token-id with an id that never occurs in the data")
    mid = free[0]
    return MaskChoice(mid, _token(tokenizer, mid), "unused special token", _seen(counts, mid, data))


def special_candidates(tokenizer, vocab_size: int, reserved=()) -> list[int]:
    """The special-token ids rule 5 may choose from, ascending (before the count check)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    ids |= {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    roles = (getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk"))
    ids -= {int(r) for r in roles if r is not None} | {int(r) for r in reserved}
    ids -= template_ids(tokenizer)
    return sorted(i for i in ids if 0 <= i < vocab_size)


def template_ids(tokenizer) -> set[int]:
    """Every id the chat template emits on :data:`SAMPLE_CHAT` (with and without its system turn,
    as the full chat and as a prompt with the generation prompt); none without a template. A
    template that renders none of them is refused (it would render no data either)."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        return set()
    out: set[int] = set()
    error = None
    for chat in (list(SAMPLE_CHAT), list(SAMPLE_CHAT[1:])):
        for prompt in (False, True):
            try:
                text = tokenizer.apply_chat_template(chat[:-1] if prompt else chat, tokenize=False,
                                                     add_generation_prompt=prompt)
            except TemplateError as e:     # e.g. a template that refuses a system turn
                error = e
                continue
            out.update(int(i) for i in tokenizer.encode(text, add_special_tokens=False))
    if not out and error is not None:
        raise ConfigError(f"the target's chat template renders no sample conversation ({error}); pass "
                          "--mask-token-id with an id that never occurs in the data")
    return out


def config_ids(hf_config) -> set[int]:
    """The target config's bos, eos and pad ids (``eos_token_id`` may be a list)."""
    out: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(hf_config, key, None)
        out.update(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None)
    return out


def recorded_mask_token(out: str | Path, *, from_scratch: bool) -> tuple[int, str] | None:
    """``(id, path)`` of the mask token ``OUT/checkpoint.pt`` recorded (its run contract), or None:
    no checkpoint to resume, ``--from-scratch``, or one with no mask token (another objective's).
    Read memory-mapped, tensors untouched; the loop's full load checks the file's digest and
    refuses a corrupt one, so an unreadable file here is left to it."""
    import torch

    from dflash_prep.train import checkpoint as ckpt

    path = Path(out) / ckpt.CKPT_FILE
    if from_scratch or not ckpt.is_checkpoint(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:   # torch raises many types for a truncated or foreign file; ckpt.load names the problem
        return None
    run_key = state.get("run_key") if isinstance(state, dict) else None
    contract = run_key.get("contract") if isinstance(run_key, dict) else None
    mid = contract.get("mask_token_id") if isinstance(contract, dict) else None
    return None if mid is None else (int(mid), str(path))


def dataset_folder(ds=None, data: str | Path | None = None) -> Path | None:
    """The tokenized dataset folder the mask token is checked against: ``ds``'s (a file dataset,
    with its ``meta.json``), else ``data`` when it holds one; None for in-memory data."""
    if ds is not None:
        return Path(ds.folder) if getattr(ds, "meta", None) is not None and getattr(ds, "folder", None) else None
    if data is not None and (Path(data) / "meta.json").is_file():
        return Path(data)
    return None


def decide(cfg, tokenizer, hf_config, data: Path | None) -> MaskChoice:
    """The run's mask token (:func:`choose_mask_token` with ``cfg``'s flag and checkpoint)."""
    return choose_mask_token(tokenizer, int(hf_config.vocab_size), cfg.options.mask_token_id, data=data,
                             recorded=recorded_mask_token(cfg.out, from_scratch=cfg.from_scratch),
                             reserved=config_ids(hf_config))

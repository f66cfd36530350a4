"""The serving (thinking) mode a dataset was made in: ``meta.json``'s ``serving_mode`` block.

A drafter learns what its target writes in one mode: with reasoning (``<think>`` blocks before
the answers) or without. Served in the other mode it drafts text the target does not write, and
the field reports 2-3x lower acceptance. So ``tokenize`` records the mode its data was made in,
the trainer carries it into the run, the export writes it into ``config.json`` and
``dflash-prep evaluate --thinking auto`` serves in it (:mod:`dflash_prep.engine.serving_mode`).

Per record, from what ``dflash-prep regenerate`` wrote beside the messages
(``regenerate.reasoning``, :data:`REASONING_MODES`): ``strip`` and ``disable`` -> ``off`` (the
drafter learns answers without reasoning); ``keep`` -> ``on`` when a turn the target wrote
(``regenerate.turns[].message``) holds a ``<think>`` block (or the end or start of one: a template
may open it in the prompt, ``--max-tokens`` may cut it), else ``off``: ``keep`` is the default, and
a target that does not think, or thinks only when asked and was not, wrote answers without
reasoning; a record without that field (or with a value this version does not know) ->
``unknown``. Only records that produced samples are counted (a skipped or dropped one trains
nothing). The dataset's mode under ``--thinking auto``: ``on`` or ``off`` when every record that
says is of that mode (records that do not say are counted, not decisive), ``mixed`` when both
occur, ``unknown`` when none says. ``--thinking on|off`` declares the mode for data that does not
carry it; declaring one that records contradict is refused (:func:`serving_mode`).

The block: ``{"thinking": "on"|"off"|"mixed"|"unknown", "source": how it was decided,
"counts": {"on", "off", "unknown"}, "chat_template_sha256": the template rendered with (hex, or
null)}``. A ``meta.json`` written before it reads as mode ``unknown`` (:func:`serving_mode_of`).
"""

from __future__ import annotations

from dflash_prep.errors import ConfigError

THINKING = ("auto", "on", "off")
"""``tokenize --thinking``: auto (from the records) or a declared mode."""
MODES = ("on", "off", "mixed", "unknown")
"""The dataset modes ``serving_mode.thinking`` takes."""
REASONING_MODES = {"keep": None, "strip": "off", "disable": "off"}
"""``regenerate --reasoning`` -> the mode its answers were written in (None: the answers say,
:func:`record_mode`)."""
THINK_MARKS = ("<think>", "</think>")
"""What marks reasoning kept in an answer: ``regenerate --reasoning keep`` puts reasoning a server
returns apart back as a leading ``<think>`` block."""
SOURCE_RECORDS = "records (regenerate --reasoning)"
SOURCE_NONE = "no record says (no regenerate --reasoning field)"
SOURCE_FLAG = "--thinking"
SOURCE_OLD = "meta.json written before serving_mode was recorded"


def record_mode(record: dict) -> str:
    """``on``, ``off`` or ``unknown``: the mode one input record's answers were written in."""
    regen = record.get("regenerate")
    reasoning = regen.get("reasoning") if isinstance(regen, dict) else None
    if not isinstance(reasoning, str) or reasoning not in REASONING_MODES:
        return "unknown"
    if reasoning != "keep":
        return REASONING_MODES[reasoning]
    return "on" if any(m in text for text in _written(record, regen) for m in THINK_MARKS) else "off"


def _written(record: dict, regen: dict) -> list[str]:
    """The text of the turns the target wrote (``regenerate.turns[].message``); every assistant
    turn's where the record does not say which."""
    msgs = record.get("messages")
    if not isinstance(msgs, list):
        return []
    turns = regen.get("turns")
    idx = [t.get("message") for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []
    picked = [msgs[i] for i in idx if isinstance(i, int) and 0 <= i < len(msgs)]
    if not picked:
        picked = [m for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"]
    return [m["content"] for m in picked if isinstance(m, dict) and isinstance(m.get("content"), str)]


def zero_counts() -> dict[str, int]:
    """Records per mode, none yet."""
    return {"on": 0, "off": 0, "unknown": 0}


def serving_mode(counts: dict[str, int], *, declared: str, template_sha256: str | None) -> dict:
    """The ``serving_mode`` block from the records' ``counts`` and ``--thinking`` (``declared``:
    auto, on or off); a declared mode that records contradict is a one-line :class:`ConfigError`."""
    if declared not in THINKING:
        raise ConfigError(f"--thinking must be one of {', '.join(THINKING)}, got {declared!r}")
    on, off = int(counts.get("on", 0)), int(counts.get("off", 0))
    counts = {"on": on, "off": off, "unknown": int(counts.get("unknown", 0))}
    if declared != "auto":
        other = "off" if declared == "on" else "on"
        if counts[other]:
            how = ("hold answers with reasoning (regenerate --reasoning keep, a <think> block kept)" if other == "on"
                   else "hold answers without reasoning (regenerate --reasoning strip or disable, or keep on a "
                        "target that wrote none)")
            raise ConfigError(f"--thinking {declared} contradicts the data: {counts[other]} record(s) {how}; "
                              f"drop --thinking (auto reads the records) or pass --thinking {other}")
        mode, source = declared, SOURCE_FLAG
    elif on and off:
        mode, source = "mixed", SOURCE_RECORDS
    elif on or off:
        mode, source = ("on" if on else "off"), SOURCE_RECORDS
    else:
        mode, source = "unknown", SOURCE_NONE
    return {"thinking": mode, "source": source, "counts": counts, "chat_template_sha256": template_sha256}


def serving_mode_of(meta: dict) -> dict:
    """A dataset ``meta.json``'s ``serving_mode`` block; for one written before it, mode
    ``unknown`` with the template hash the tokenizer record holds."""
    block = meta.get("serving_mode")
    if isinstance(block, dict) and block.get("thinking") in MODES:
        return dict(block)
    tmpl = ((meta.get("tokenizer") or {}).get("chat_template") or {}).get("sha256")
    return {"thinking": "unknown", "source": SOURCE_OLD, "counts": None, "chat_template_sha256": tmpl}


def dataset_serving_mode(ds) -> dict | None:
    """:func:`serving_mode_of` a training dataset's ``meta``; None for a source without one (the
    trainer's in-memory test sources). What the trainer records in the run (log header and the
    checkpoint's ``extra``) and the export writes into ``config.json``."""
    meta = getattr(ds, "meta", None)
    return serving_mode_of(meta) if isinstance(meta, dict) else None


def describe(block: dict) -> str:
    """One line for reports: the mode, how it was decided and the counts."""
    c = block.get("counts") or {}
    counts = f"; records on {c['on']:,}, off {c['off']:,}, unknown {c['unknown']:,}" if c else ""
    return f"thinking {block['thinking']} ({block['source']}{counts})"

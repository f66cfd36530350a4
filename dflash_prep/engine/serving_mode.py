"""The serving (thinking) mode travels with the drafter: the export's ``dflash_prep`` block, read back.

A drafter learns the text its target writes in one mode, with reasoning or without. Served in the
other (the chat-template kwarg ``enable_thinking``), it drafts text the target does not write:
the field reports 2-3x lower tau when the modes differ. A chat template other than the one the
data was rendered with shifts every prompt the same way. So the mode and the template's hash go
from ``tokenize`` (``meta.json`` ``serving_mode``, :mod:`dflash_prep.tokenize.thinking`) through
the run's checkpoint into the export's ``config.json``, in a block of our own that vLLM ignores
(it keeps unknown config keys as attributes and reads none of them):

    "dflash_prep": {"version": 1, "thinking": "on"|"off"|"mixed"|"unknown", "thinking_source": ...,
                    "chat_template_sha256": hex or null, "dataset_fingerprint": ..., "recipe": {...}}

(:func:`export_block` writes it, :func:`training_mode` reads it). ``dflash-prep evaluate
--thinking on|off|auto`` sends ``enable_thinking`` as :func:`resolve_thinking` decides (auto: the
mode the exports were trained in) and prints :func:`mode_warnings`. No torch here.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.errors import ConfigError, FormatError

BLOCK_KEY = "dflash_prep"
"""The export ``config.json`` key of our block."""
BLOCK_VERSION = 1
FLAGS = ("on", "off", "auto")
"""``evaluate --thinking``."""
COST = "the field reports 2-3x lower tau when the modes differ"


def export_block(*, serving: dict | None, dataset_fingerprint: str | None, recipe: dict) -> dict:
    """The ``dflash_prep`` block of an export's ``config.json``: the run's ``serving`` mode (the
    dataset's ``serving_mode`` block, None when the run recorded none), its dataset's fingerprint
    and its training ``recipe`` (small, JSON)."""
    serving = serving or {}
    return {"version": BLOCK_VERSION, "thinking": serving.get("thinking", "unknown"),
            "thinking_source": serving.get("source", "the run recorded no serving mode"),
            "chat_template_sha256": serving.get("chat_template_sha256"),
            "dataset_fingerprint": dataset_fingerprint, "recipe": dict(recipe)}


def training_mode(export_dir: Path) -> dict | None:
    """The ``dflash_prep`` block of an export's ``config.json``, or None for an export written
    before the block existed (or by another tool)."""
    cfile = Path(export_dir) / "config.json"
    if not cfile.is_file():
        raise FormatError(f"{cfile}: not found; point at an exported drafter folder "
                          "(python -m dflash_prep.train.export RUN --out DIR)")
    try:
        c = json.loads(cfile.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{cfile}: not valid JSON ({e})") from None
    block = c.get(BLOCK_KEY) if isinstance(c, dict) else None
    if block is None:
        return None
    if not isinstance(block, dict) or block.get("version") != BLOCK_VERSION:
        got = block.get("version") if isinstance(block, dict) else type(block).__name__
        raise FormatError(f"{cfile}: the {BLOCK_KEY!r} block has version {got!r}, this dflash-prep reads "
                          f"{BLOCK_VERSION}; evaluate with the dflash-prep that exported it, or export the run again")
    return dict(block)


def _known(block: dict | None) -> str | None:
    """The block's mode when it is one an evaluation can render with (on/off), else None."""
    mode = (block or {}).get("thinking")
    return mode if mode in ("on", "off") else None


def mode_warnings(*, export_dir: Path, requested: str, template_sha: str | None) -> list[str]:
    """One line per mismatch between how an evaluation runs and how the drafter at ``export_dir``
    was trained: the evaluation's mode (``requested``: on, off, or ``default`` when the template's
    default is used) against the training mode, and the target's chat-template hash
    (``template_sha``, :func:`dflash_prep.tokenize.identity.tokenizer_template_sha256`) against the
    one trained on. Each names the likely cost and the flag that matches. Nothing when they match;
    when the training mode is unknown or mixed (or not recorded) and the template's default is
    used, one line saying so."""
    if requested not in ("on", "off", "default"):
        raise ConfigError(f"requested must be on, off or default, got {requested!r}")
    block = training_mode(export_dir)
    name, out = str(export_dir), []           # the path: two exports are often both named "drafter"
    trained = _known(block)
    if trained is None:
        if requested == "default":
            what = (f"was trained in mode {block['thinking']!r} ({block['thinking_source']})" if block
                    else "records no training mode (exported before dflash-prep recorded it)")
            out.append(f"{name}: {what}: --thinking auto cannot decide and uses the template's default; pass "
                       "--thinking on or --thinking off to choose")
    elif requested != trained:
        now = "the template's default mode" if requested == "default" else f"thinking {requested}"
        out.append(f"{name}: evaluated with {now}, but trained on data made with thinking {trained} "
                   f"({block['thinking_source']}); {COST}: pass --thinking {trained}")
    want = (block or {}).get("chat_template_sha256")
    if want is not None and template_sha != want:
        have = template_sha[:12] if template_sha else "none"
        out.append(f"{name}: the target's chat template ({have}) is not the one the drafter was trained on "
                   f"({want[:12]}); prompts render differently from training and tau drops: evaluate with the "
                   "target the drafter was trained on (or re-tokenize and retrain with this template)")
    return out


def resolve_thinking(flag: str, export_dirs: list[Path]) -> tuple[bool | None, str]:
    """``evaluate --thinking``: ``(enable_thinking, one line)``; True/False is sent as the
    chat-template kwarg, None leaves the template's default. ``auto``: the mode the exports were
    trained in; exports trained in different modes are a :class:`ConfigError` (pass
    ``--thinking``); none known: the template's default."""
    if flag not in FLAGS:
        raise ConfigError(f"--thinking must be one of {', '.join(FLAGS)}, got {flag!r}")
    if flag != "auto":
        return flag == "on", f"--thinking {flag}: enable_thinking={'true' if flag == 'on' else 'false'} sent to " \
                             "the chat template"
    modes = {Path(d): _known(training_mode(d)) for d in export_dirs}
    known = {m for m in modes.values() if m is not None}
    if len(known) > 1:
        each = ", ".join(f"{d.name or d}: {m or 'unknown'}" for d, m in modes.items())
        raise ConfigError(f"--thinking auto: the exports were trained in different modes ({each}); pass "
                          "--thinking on or --thinking off (evaluate each export in its own mode for its tau)")
    if not known:
        return None, ("--thinking auto: no export records an on/off training mode; the template's default is used "
                      "(enable_thinking not sent)")
    mode = known.pop()
    unknown = [d.name or str(d) for d, m in modes.items() if m is None]
    also = f" ({', '.join(unknown)}: no training mode recorded)" if unknown else ""
    return mode == "on", (f"--thinking auto: thinking {mode}, the mode the drafter was trained in{also}; "
                          f"enable_thinking={'true' if mode == 'on' else 'false'} sent to the chat template")

"""The drafter's load into vLLM: the strict-load verdict on the report our vLLM plugin writes
(:mod:`dflash_prep.engine.load_report`), and what to say when the engine refuses an export.

Strict (:func:`strict_load`): every export tensor reached a draft parameter (except those vLLM skips
by name, listed with its reason) and no draft parameter was left unloaded (one the engine shares
from the target counts as loaded). A refusal (:func:`refusal`) keeps the engine's own words and adds
what the load report and the export's files (:func:`likely_causes`) say that the engine does not.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.engine.load_report import REPORT_FORMAT
from dflash_prep.engine.method import Method
from dflash_prep.errors import EngineError
from dflash_prep.formats.fileio import read_json


def strict_load(report: dict) -> dict:
    """The verdict on vLLM's load report: ``ok`` when every export tensor reached a draft parameter
    (except those vLLM skips by name, listed with its reason) and no draft parameter was left
    unloaded (a parameter the engine shares from the target counts as loaded)."""
    params = report.get("params") or {}
    unused = [n for n in report.get("unused", []) if n not in (report.get("engine_skips") or {})]
    by = lambda s: sorted(n for n, p in params.items() if p["status"] == s)  # noqa: E731
    missing = by("missing") + [f"{n} ({params[n]['elements_written']} of {_numel(params[n]['shape'])} elements loaded)"
                               for n in by("partial")]
    return {"ok": not unused and not missing and report.get("error") is None, "draft_class": report.get("draft_class"),
            "tensors": len(report.get("tensors") or {}), "used": len(report.get("used") or []),
            "unused": unused, "engine_skips": report.get("engine_skips") or {}, "missing": missing,
            "shared_with_target": by("shared"), "unused_by_engine": by("unused"), "loaded": len(by("loaded"))}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def strict_message(export: Path, s: dict) -> str:
    """The one-line refusal of a load that :func:`strict_load` (``s``) found not strict."""
    parts = []
    if s["missing"]:
        parts.append(f"draft parameters left unloaded: {', '.join(s['missing'])} (the export lacks their tensors; "
                     "vLLM does not check this for drafters and would serve them uninitialised)")
    if s["unused"]:
        parts.append(f"export tensors vLLM did not use: {', '.join(s['unused'])}")
    return f"{export}: not a strict load into vLLM's {s['draft_class']}: " + "; ".join(parts)


def read_load_report(path: Path, export: Path | None, *, required: bool = True) -> dict | None:
    """The plugin's report at ``path``; None when there is none and it is not ``required`` (an
    engine that failed before the draft's load), an :class:`EngineError` naming the fix when it is."""
    if not path.is_file():
        if required:
            raise EngineError(f"{export}: vLLM started but our load-report plugin wrote no {path.name}; is dflash-prep "
                              "installed in the engine's venv (`make venv-vllm` does it)?")
        return None
    return read_json(path, format=REPORT_FORMAT)


# ----------------------------------------------------------------------------- a refused load
def refusal(e: EngineError, *, export: Path, target: Path, method: Method, report_file: Path) -> EngineError:
    """The error to raise for an engine that failed with ``e`` while serving ``export``: the draft
    load's own error from the report when ``e`` lacks it, DFlash2's need of the V2 runner said
    plainly, and :func:`likely_causes` appended."""
    load = read_load_report(report_file, export, required=False)
    extra = ""
    if load is not None and load.get("error"):
        extra = f" (loading the draft: {load['error']})" if load["error"] not in str(e) else ""
    if method.serving.v2_runner_only and "Model Runner V1 does not support" in str(e):
        return EngineError(f"{export}: a {method.serving.label} export needs vLLM's V2 model runner (Triton; GPU), "
                           f"which this vLLM build does not run; engine: {e}")
    causes = likely_causes(export, target, method)
    hint = f" [the export: {'; '.join(causes)}]" if causes else ""
    return EngineError(f"{export}: vLLM refused the export{extra}: {e}{hint}")


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a ``.safetensors`` header (8-byte little-endian length, then JSON),
    read without torch; {} when the file is unreadable."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < 1 << 28 else {}
    except (OSError, ValueError):
        return {}
    return {k: list(v.get("shape", [])) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def likely_causes(export: Path, target: Path, method: Method) -> list[str]:
    """What in the export contradicts the target or itself, checked from the files alone; added to
    an engine's refusal, whose own message (often ``ValueError: too many values to unpack``) does
    not say. Never a reason to refuse by itself: the engine decides."""
    try:
        c = json.loads((export / "config.json").read_text())
        L = int(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return method.serving.problems(c, L, lambda: safetensors_shapes(export / "model.safetensors"))

"""A DFlash2 export served by vLLM, where vLLM is installed; where it is not, a record that says so.

    PYTHONPATH=. python3 -m dflash_prep.bench.engine_dflash2 --out DIR          # part of make bench-gpu
    PYTHONPATH=. python3 -m dflash_prep.bench.engine_dflash2 --smoke --out DIR  # CPU: build, find vLLM, no engine

vLLM runs DFlash2 (``DFlash2DraftModel``: DFlash plus candidate heads) only on its V2 model
runner, which needs Triton on a GPU; the CPU build refuses it at start-up (docs/engines.md). This
step is the check a GPU machine can make. It builds the tiny target and a random DFlash2 export of
:mod:`bench.tiny_engine` (the engine tests' own), then looks for vLLM the way ``dflash-prep
evaluate`` does (``$DFLASH_PREP_VLLM_PYTHON``, ``.venv-vllm``), and in this interpreter too:

- no vLLM anywhere: ``status`` ``"not-run"`` with the reason, ``passed: null``, exit
  :data:`bench.gpu_all.NOT_RUN` (nothing was checked, so nothing passed);
- ``--smoke``: ``"smoke"``, the export built and vLLM found or not, no engine started
  (``make test-engines`` starts it on CPU);
- otherwise ``dflash-prep evaluate`` on the export on two shipped benchmarks (:data:`BENCH`,
  :data:`BENCH_N` prompts each; MT-Bench's second turns after the target's own answers; 32 new
  tokens, float32, temperature 0): ``"served"`` with the strict load, the lossless count, vLLM's tau
  and ours, pooled and per benchmark; exit 0 only when the load was strict and every prompt lossless. A refusal is ``"refused"`` with the engine's
  line: expected on a machine without CUDA (exit 0, ``expected: true``), a failure on a GPU.

vLLM loads the project's load-report plugin through the ``vllm.general_plugins`` entry point of
the installed distribution. When the engine is this interpreter and dflash-prep is not installed in
it (the GPU machine: ``PYTHONPATH=.``), the step puts a minimal ``.dist-info`` declaring that entry
point on the engine's ``PYTHONPATH``, so the strict-load check runs there too.
Output: ``--out/engine_dflash2.json`` (format ``dflash-prep/bench-engine-dflash2`` v1), and where an
engine started, ``--out/eval.json`` (``dflash-prep evaluate``'s report, v2), its table ``eval.md``
and its logs in ``--out/eval.logs/``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from dflash_prep.bench.gpu_all import finish_step

FORMAT = "dflash-prep/bench-engine-dflash2"
ROOT = Path(__file__).resolve().parents[1]
BENCH = ("gsm8k", "mt-bench")
"""The shipped benchmarks the served export is evaluated on: one single-turn, one two-turn."""
BENCH_N = 4
PLUGIN = ("dflash_prep_load_report", "dflash_prep.engine.load_report:register")
"""The ``vllm.general_plugins`` entry point pyproject.toml declares (name, object)."""


def find_engine() -> tuple[Path | None, str]:
    """``(python, "<distribution> <version>")`` of a vLLM, or ``(None, why there is none)``."""
    from dflash_prep.engine.env import engine_python, engine_version
    from dflash_prep.errors import EngineError

    try:
        py = engine_python("vllm")
        return py, engine_version("vllm", py)
    except EngineError as e:
        why = str(e)
    if importlib.util.find_spec("vllm") is not None:
        try:
            return Path(sys.executable), engine_version("vllm", sys.executable)
        except EngineError as e:
            why = str(e)
    return None, f"no vLLM on this machine: {why}"


def _plugin_installed() -> bool:
    return any(ep.name == PLUGIN[0] for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def plugin_site(folder: Path) -> Path:
    """A folder holding a minimal distribution whose only content is the load-report entry point."""
    dist = folder / "dflash_prep_load_report_shim-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dflash-prep-load-report-shim\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN[0]} = {PLUGIN[1]}\n")
    return folder


def cuda_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def run(work: Path, out: Path, *, smoke: bool, timeout_s: float = 240.0, dtype: str = "float32") -> dict:
    """Build under ``work``, find vLLM, serve (unless there is none or ``smoke``; the evaluation's
JSON and the engines' logs go to ``out``); the record (module docstring)."""
    from dflash_prep.bench.tiny_engine import build_exports, build_target

    t0 = time.monotonic()
    target = build_target(work)
    export = build_exports(work, target, kinds=("dflash2",))["dflash2"]
    python, version = find_engine()
    rec = dict(cuda=cuda_name(), vllm=version if python else None, vllm_python=str(python) if python else None,
               export={"architecture": json.loads((export / "config.json").read_text())["architectures"][0],
                       "built_s": round(time.monotonic() - t0, 1)})
    if python is None:
        return dict(rec, status="not-run", reason=version, passed=None)
    if smoke:
        return dict(rec, status="smoke", reason="--smoke starts no engine; make test-engines serves exports in vLLM on CPU",
                    passed=True)
    from dflash_prep.engine.evaluate import evaluate_exports
    from dflash_prep.errors import EngineError

    os.environ["DFLASH_PREP_VLLM_PYTHON"] = str(python)
    if Path(python).resolve() == Path(sys.executable).resolve() and not _plugin_installed():
        paths = [str(plugin_site(work / "plugin-site")), str(ROOT), os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        rec["load_report_plugin"] = "shim .dist-info on PYTHONPATH"
    try:
        res = evaluate_exports(target=target, exports=[export], benches=list(BENCH), out=out / "eval.json",
                               n=BENCH_N, max_tokens=32, timeout_s=timeout_s, dtype=dtype, log=print)
    except EngineError as e:
        expected = rec["cuda"] is None and "V2 model runner" in str(e)
        return dict(rec, status="refused", error=str(e), expected=expected, passed=expected)
    e = res["exports"][0]
    sets = {name: {"tau_vllm": c["vllm"]["tau"], "tau_ours": (c["ours"] or {}).get("tau_pooled"),
                   "agree": (c["ours"] or {}).get("agree"), "lossless": c["lossless"]}
            for name, c in e["sets"].items()}
    lossless_ok = all(c["lossless"]["ok"] is True for c in e["sets"].values())
    return dict(rec, status="served", strict_load=e["strict_load"], sets=sets, tau_vllm=e["vllm"]["tau"],
                seconds=res["seconds"], speculative_config=e["speculative_config_json"],
                passed=bool(e["strict_load"].get("ok")) and lossless_ok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.engine_dflash2", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for engine_dflash2.json")
    ap.add_argument("--smoke", action="store_true", help="build the export and look for vLLM; start no engine")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="the engine's start-up limit (default 240)")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (default float32: lossless is exact)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-dflash2-") as tmp:  # the models stay out of $OUT
        rec = run(Path(tmp), a.out, smoke=a.smoke, timeout_s=a.timeout_s, dtype=a.dtype)
    return finish_step(a.out / "engine_dflash2.json", rec, format=FORMAT)


if __name__ == "__main__":
    raise SystemExit(main())

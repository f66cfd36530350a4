"""Colocated vs split (``--target-ranks``) DFlash training on CPU, on the demo target's shape.

``python -m dflash_prep.bench.target_split [--steps 12] [--out FILE]`` builds the demo's tiny Qwen3 target
(``make demo-dflash``'s shape: vocab 512, H = 64, 4 layers; random weights: timing only), a
synthetic corpus tokenized with its tokenizer, a 2,048-token plan and ``pack --objective dflash``
manifests (B = 8, 64 anchors, one draft layer) for W = 1 and W = 2, then trains ``--steps``
steps through the real launcher (``python -m dflash_prep.train.launch --standalone``, gloo) as

- ``colocated W=1`` / ``colocated W=2``: every drafter process holds the target;
- ``split 1:1`` / ``split 1:2``: one target process feeding one / two drafter processes.

Per case: the job's wall time (process start to exit: imports, loads and the steps), the
trainer's own step time (``summary.json`` ``time_s``), tokens/s, and for the split cases the
target rank's busy fraction, the drafter's wait fraction, the summary's bottleneck and its
suggested K. Prints one JSON object (and writes it to ``--out``). On a machine with fewer cores
than processes the split cases pay for the contention: read the fractions, not only the times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"colocated W=1": (0, 1), "colocated W=2": (0, 2), "split 1:1": (1, 1), "split 1:2": (1, 2)}
B, MAX_ANCHORS, BUDGET = 8, 64, 2048


def build(root: Path, n: int = 600) -> dict:
    """Target, corpus, data, plan and manifests for W = 1 and W = 2 under ``root``."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    spec = TargetSpec(vocab_size=512, hidden=64, layers=4, heads=2, kv_heads=1, head_dim=32, intermediate=192)
    target = build_target(root / "target", spec, texts=default_texts(20_000))
    synth(SynthConfig(out=root / "corpus", profile="mini", n=n, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=1024, on_overflow="drop"))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=BUDGET), seed=0),
                  root / "plan")
    d = drafter_options(target_config=target, draft_layers=1, block_size=B, max_anchors=MAX_ANCHORS,
                        sliding_window=0)   # the runs train with --sliding-window 0
    for w in (1, 2):
        pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / f"man-w{w}",
                    config=PackConfig(objective="dflash", options=d, world_size=w, grad_accum=1))
    return {"target": str(target), "data": str(root / "data"), "plan": str(root / "plan" / "plan.json"),
            "manifests": {w: str(root / f"man-w{w}") for w in (1, 2)}}


def run_case(paths: dict, root: Path, name: str, K: int, W: int, steps: int) -> dict:
    out = root / "runs" / name.replace(" ", "_").replace(":", "-").replace("=", "")
    cmd = [sys.executable, "-m", "dflash_prep.train.launch", "--standalone", "--nproc_per_node", str(K + W),
           "-m", "dflash_prep.train", "--objective", "dflash", "--target", paths["target"], "--data", paths["data"],
           "--plan", paths["plan"], "--manifests", paths["manifests"][W], "--out", str(out), "--device", "cpu",
           "--no-progress", "--draft-layers", "1", "--block-size", str(B), "--max-anchors", str(MAX_ANCHORS),
           "--slot-weights", "decay", "--optimizer", "adamw", "--sliding-window", "0", "--max-steps", str(steps),
           "--from-scratch", "--no-pack-missing", "--target-ranks", str(K)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{name}: exit {p.returncode}\n{p.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    keys = ("target_busy_frac", "drafter_wait_frac", "bottleneck", "suggested_target_ranks")
    return {"processes": K + W, "job_wall_s": wall, "train_time_s": s["time_s"], "steps": s["steps"],
            "tokens_per_s": s["tokens_per_s"], **{k: s[k] for k in keys if k in s}}


def run(steps: int = 12) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        root = Path(tmp)
        paths = build(root)
        cases = {name: run_case(paths, root, name, K, W, steps) for name, (K, W) in CASES.items()}
    return {"bench": "target_split", "steps": steps, "cpus": os.cpu_count(), "block_size": B, "budget": BUDGET,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": cases}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    res = run(a.steps)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

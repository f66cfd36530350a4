"""Drafters trained from a vLLM states cache against drafters trained beside the transformers target.

``python -m dflash_prep.bench.states_equivalence DEMO [--out FILE] [--steps N]`` takes a folder
written by ``make demo-dflash OBJECTIVE=eagle3 DEMO_DFLASH=DEMO`` (the demo's target, its
regenerated data, the plan, ``pack --objective dflash`` and ``--objective eagle3`` manifests and
held-out prompts) and, with every setting of the demo's own drafter stages (DFlash: one draft layer,
B = 8, 64 anchors, decay weights, CE, AdamW; EAGLE-3: taps 0 1 2, 64-id draft vocabulary, 7 TTT
steps; 5 epochs, ``--steps`` steps, lr 3e-3, seed 0), runs in one go:

1. ``dflash-prep extract`` (vLLM, from ``$DFLASH_PREP_VLLM_PYTHON`` or ``.venv-vllm``), computing in
   float32 (the target's dtype), for each objective a ``bf16`` and an ``fp8`` cache, and one
   ``fp32`` EAGLE-3 cache to measure the states themselves: the largest ``|vLLM - FrozenTarget|``
   per slot over every token;
2. the trainer three times per objective, the same data, steps and seed: ``--target-engine hf``
   (the target runs every step), then ``--target-engine vllm`` on the bf16 and on the fp8 cache;
3. the export and our evaluator (``python -m dflash_prep.train.speculate``: speculative decoding
   of the held-out prompts at temperature 0 against the transformers target) of each, and with
   ``--vllm-tau`` vLLM's own (``dflash-prep evaluate``: the export served by vLLM, tau from its
   counters, strict load, lossless);
4. DFlash2 as the demo trains it: ``pack --objective dflash2``, then ``--dflash2-steps`` steps (lr 1e-3)
   warm-started from the DFlash drafter of step 2's ``hf`` run, beside the transformers target and
   from the DFlash bf16 cache (the same taps); our evaluator's tau, and vLLM's answer (on CPU its
   refusal: DFlash2 needs the V2 model runner).

``--online`` adds, for DFlash and EAGLE-3, a run with the target online in vLLM beside the trainer
(``--target-engine vllm`` without a cache: bf16 states, the engine in float32), with its engine's
start, calls and time. ``--objectives`` runs a subset (``dflash`` alone needs only a ``make
demo-dflash`` folder).

``--reuse`` keeps what an earlier run left in the work folder (complete caches, finished runs,
evaluations) and does only the rest.

Prints one JSON object (and writes it to ``--out``): per objective and engine the first and last
training losses, the largest per-step loss difference to ``hf``, tau (and whether the decoding
was lossless), the extract's wall time and the cache's size, the trainer's time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
DFLASH = ["--objective", "dflash", "--draft-layers", "1", "--block-size", "8", "--max-anchors", "64",
          "--slot-weights", "decay", "--loss", "ce", "--optimizer", "adamw", "--sliding-window", "0"]
EAGLE3 = ["--objective", "eagle3", "--target-layer-ids", "0", "--target-layer-ids", "1", "--target-layer-ids", "2",
          "--optimizer", "adamw"]
DFLASH2 = ["--objective", "dflash2", *DFLASH[2:]]
"""The demo's DFlash2 stage: DFlash's shape (its taps too, so it reads the DFlash cache) plus the
convolutions and the selector at their defaults, warm-started from the DFlash drafter."""


def _recipe(objective: str, work: Path) -> tuple[list[str], str, str]:
    """``(trainer flags, manifests folder under DEMO or WORK, lr)`` of an objective's run."""
    if objective == "dflash2":
        return [*DFLASH2, "--init-from-drafter", str(work / "drafter-dflash-hf")], str(work / "manifests-dflash2"), "1e-3"
    return (DFLASH if objective == "dflash" else EAGLE3), ("manifests-eagle3" if objective == "eagle3" else "manifests"), "3e-3"


def _run(cmd: list[str], log: Path) -> float:
    t = time.monotonic()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {r.returncode}); see {log}")
    return round(time.monotonic() - t, 1)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()[1:]) if "loss" in r]


def extract(demo: Path, work: Path, objective: str, dtype: str, reuse: bool = False) -> dict:
    out = work / f"states-{objective}-{dtype}"
    taps = ["--draft-layers", "1"] if objective == "dflash" else EAGLE3[2:8]
    done = reuse and (out / "states.json").is_file() and json.loads((out / "states.json").read_text()).get("complete")
    secs = None if done else _run([PY, "-m", "dflash_prep.cli", "extract", str(demo / "data"), "--target", str(demo / "target"),
                 "--objective", objective, *taps, "--dtype", dtype, "--engine-arg", "dtype=float32",
                 "--out", str(out), "--overwrite"], work / f"extract-{objective}-{dtype}.log")
    h = json.loads((out / "states.json").read_text())
    secs = secs if secs is not None else h.get("build", {}).get("seconds")
    return {"cache": str(out), "extract_s": secs, "bytes": h["totals"]["bytes"], "tokens": h["totals"]["tokens"],
            "bytes_per_token": h["bytes_per_token"], "engine": h["engine"]["version"]}


ONLINE = ["--target-engine", "vllm", "--engine-arg", "dtype=float32"]
"""The online target's flags: vLLM beside the trainer, computing in float32, its states rounded to
bf16 (the default ``--states-dtype``), the default batching."""


def engine_flags(cache: str | None) -> list[str]:
    """The trainer's flags of a run on ``cache`` (None: the transformers target)."""
    return ["--target-engine", "vllm", "--states", cache] if cache else []


def train_and_eval(demo: Path, work: Path, objective: str, engine: str, extra: list[str], steps: int, *,
                   reuse: bool = False, vllm_tau: bool = False) -> dict:
    name = f"{objective}-{engine}"
    run, export = work / f"run-{name}", work / f"drafter-{name}"
    flags, manifests, lr = _recipe(objective, work)
    manifests = demo / manifests
    ev_file = work / f"eval-{name}.json"
    if not (reuse and ev_file.is_file()):
        _run([PY, "-m", "dflash_prep.train", "--device", "cpu", "--no-progress",
              *flags, "--target", str(demo / "target"), "--data",
              str(demo / "data"), "--plan", str(demo / "plan" / "plan.json"), "--manifests", str(manifests), "--out",
              str(run), "--epochs", "5", "--max-steps", str(steps), "--lr", lr, "--warmup-steps", "5", "--seed", "0",
              "--from-scratch", *extra], work / f"train-{name}.log")
        _run([PY, "-m", "dflash_prep.train.export", str(run), "--out", str(export), "--overwrite"],
             work / f"export-{name}.log")
        block = ["--block-size", "8"]          # DFlash(2): B = 8; EAGLE-3: chains of 7 (TTT steps + 1)
        _run([PY, "-m", "dflash_prep.train.speculate", "--target", str(demo / "target"), "--drafter", str(export),
              "--prompts", str(demo / "corpus" / "heldout.jsonl"), "--out", str(ev_file), "--max-new-tokens", "64",
              *block], work / f"eval-{name}.log")
    ev = json.loads(ev_file.read_text())
    s = json.loads((run / "summary.json").read_text())
    out = {"losses": _losses(run), "loss_first": s["loss_first"], "loss_last": s["loss_last"], "tau": ev["tau"],
           "lossless": ev["lossless"], "train_time_s": s.get("time_s")}
    if "target_engine" in s:          # the online target: its start, calls and time in the engine
        out["target_engine"] = s["target_engine"]
    if vllm_tau:
        vf = work / f"vllm-eval-{name}.json"
        cmd = [PY, "-m", "dflash_prep.cli", "evaluate", "--target", str(demo / "target"), "--export", str(export),
               "--prompts", str(demo / "corpus" / "heldout.jsonl"), "--out", str(vf), "--no-ours"]
        if objective == "dflash2":     # vLLM serves DFlash2 on its V2 runner only (GPU): keep the engine's answer
            log = work / f"vllm-eval-{name}.log"
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            line = next((ln for ln in log.read_text().splitlines() if ln.startswith("error:")), "")
            out["vllm_evaluate"] = (_vllm_fields(json.loads(vf.read_text())) if rc == 0 else
                                    {"refused": line[len("error: "):].strip() or f"exit {rc}; see {log}"})
        else:
            if not (reuse and vf.is_file()):
                _run(cmd, work / f"vllm-eval-{name}.log")
            out["vllm_evaluate"] = _vllm_fields(json.loads(vf.read_text()))
    return out


def _vllm_fields(r: dict) -> dict:
    """tau from vLLM's counters, lossless and strict load of a ``dflash-prep evaluate`` report."""
    return {"tau": r["vllm"]["tau"], "drafts": r["vllm"]["num_drafts"], "accepted": r["vllm"]["num_accepted_tokens"],
            "lossless": bool(r["lossless"]["ok"]), "strict_load": bool(r["strict_load"]["ok"])}


def dflash2_rows(demo: Path, work: Path, steps: int, *, reuse: bool, vllm_tau: bool) -> dict:
    """DFlash2 as the demo trains it (warm-started from the DFlash drafter trained beside the target,
    ``steps`` steps, lr 1e-3, manifests packed for ``--objective dflash2``), beside the transformers
    target and from the DFlash bf16 cache (the same taps: one cache serves both objectives)."""
    manifests = work / "manifests-dflash2"
    if not (reuse and (manifests / "root.json").is_file()):
        _run([PY, "-m", "dflash_prep.cli", "pack", str(demo / "data"), "--plan", str(demo / "plan" / "plan.json"),
              "--epochs", "0-4", "--objective", "dflash2", "--block-size", "8", "--max-anchors", "64", "--target-config",
              str(demo / "target"), "--draft-layers", "1", "--sliding-window", "0", "--world-size", "1", "--out",
              str(manifests), "--overwrite"], work / "pack-dflash2.log")
    kw = dict(reuse=reuse, vllm_tau=vllm_tau)
    rows = {"hf": train_and_eval(demo, work, "dflash2", "hf", [], steps, **kw)}
    cache = work / "states-dflash-bf16"
    r = train_and_eval(demo, work, "dflash2", "vllm-bf16", engine_flags(str(cache)), steps, **kw)
    r["max_loss_diff_vs_hf"] = max(abs(p - q) for p, q in zip(r["losses"], rows["hf"]["losses"]))
    rows["vllm-bf16"] = {**r, "cache": "the DFlash bf16 cache (same taps)"}
    for r in rows.values():
        r.pop("losses")
    return rows


def states_diff(demo: Path, cache: str) -> list[float]:
    """Per slot, the largest |vLLM's state - FrozenTarget's| over every token of every sample."""
    import numpy as np
    import torch

    from dflash_prep.formats.dataset import open_dataset
    from dflash_prep.formats.states import decode_torch, open_states
    from dflash_prep.train.target import FrozenTarget

    torch.set_num_threads(1)
    c = open_states(cache)
    ds = open_dataset(demo / "data")
    taps = list(c.key.taps)
    ft = FrozenTarget(demo / "target", taps, device=torch.device("cpu"))
    worst = np.zeros(c.key.slots)
    for sid in range(c.num_samples):
        ids = torch.from_numpy(ds.sample(sid)[0].astype(np.int64))
        T = len(ids)
        t, last = ft.features(ids, torch.arange(T), torch.tensor([0, T], dtype=torch.int32), T, final=True)
        ref = torch.cat([t.view(T, len(taps), -1), last[:, None]], 1) if c.key.final else t.view(T, len(taps), -1)
        worst = np.maximum(worst, (decode_torch(*c.sample(sid), c.key.dtype) - ref).abs().amax(dim=(0, 2)).numpy())
    return [float(w) for w in worst]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("demo", type=Path, help="a `make demo-dflash OBJECTIVE=eagle3` folder")
    ap.add_argument("--work", type=Path, default=None, help="where caches and runs go (default: DEMO/states-bench)")
    ap.add_argument("--steps", type=int, default=700, help="training steps of every run (the demo's DRAFT_STEPS)")
    ap.add_argument("--dflash2-steps", type=int, default=300, help="DFlash2's warm-started steps (the demo's DRAFT2_STEPS)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="keep the caches, runs and evaluations already in --work")
    ap.add_argument("--vllm-tau", action="store_true", help="also measure tau in vLLM (dflash-prep evaluate)")
    ap.add_argument("--online", action="store_true",
                    help="also train each objective with the target online in vLLM (--target-engine vllm, no cache)")
    ap.add_argument("--objectives", default="dflash,eagle3,dflash2",
                    help="which of dflash, eagle3, dflash2 (comma-separated); the states' own difference is measured "
                         "with eagle3, and dflash2 warm-starts from the dflash runs")
    a = ap.parse_args(argv)
    objectives = [o.strip() for o in a.objectives.split(",") if o.strip()]
    if set(objectives) - {"dflash", "eagle3", "dflash2"} or ("dflash2" in objectives and "dflash" not in objectives):
        ap.error(f"--objectives {a.objectives}: choose among dflash, eagle3, dflash2 (dflash2 needs dflash)")
    work = a.work or a.demo / "states-bench"
    work.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "steps": a.steps, "cpus": os.cpu_count()}
    if "eagle3" in objectives:
        fp32 = extract(a.demo, work, "eagle3", "fp32", a.reuse)
        diff_file = work / "states-diff.json"
        if a.reuse and diff_file.is_file():
            diff = json.loads(diff_file.read_text())
        else:
            diff = states_diff(a.demo, fp32["cache"])
            diff_file.write_text(json.dumps(diff))
        res["states_max_abs_diff"] = {"slots": ["tap 0", "tap 1", "tap 2", "final"], "vllm_vs_frozen_target": diff,
                                      **fp32}
    for objective in [o for o in ("dflash", "eagle3") if o in objectives]:
        kw = dict(reuse=a.reuse, vllm_tau=a.vllm_tau)
        rows = {"hf": train_and_eval(a.demo, work, objective, "hf", [], a.steps, **kw)}
        for dtype in ("bf16", "fp8"):
            x = extract(a.demo, work, objective, dtype, a.reuse)
            r = train_and_eval(a.demo, work, objective, f"vllm-{dtype}", engine_flags(x["cache"]), a.steps, **kw)
            r["max_loss_diff_vs_hf"] = max(abs(p - q) for p, q in zip(r["losses"], rows["hf"]["losses"]))
            rows[f"vllm-{dtype}"] = {**r, **{f"cache_{k}": v for k, v in x.items() if k != "cache"}}
        if a.online:
            r = train_and_eval(a.demo, work, objective, "vllm-online", ONLINE, a.steps, **kw)
            r["max_loss_diff_vs_hf"] = max(abs(p - q) for p, q in zip(r["losses"], rows["hf"]["losses"]))
            r["max_loss_diff_vs_bf16_cache"] = max(abs(p - q) for p, q in zip(r["losses"], rows["vllm-bf16"]["losses"]))
            rows["vllm-online"] = r
        for r in rows.values():
            r.pop("losses")
        res[objective] = rows
    if "dflash2" in objectives:
        res["dflash2"] = dflash2_rows(a.demo, work, a.dflash2_steps, reuse=a.reuse, vllm_tau=a.vllm_tau)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()

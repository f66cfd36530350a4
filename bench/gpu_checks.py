"""Correctness on the GPU before any timing: the kernels against their references, and a few
trainer steps on CUDA (the first steps of :mod:`bench.gpu_all`).

    PYTHONPATH=. python3 -m dflash_prep.bench.gpu_checks --out DIR            # CUDA, about a minute
    PYTHONPATH=. python3 -m dflash_prep.bench.gpu_checks --smoke --out DIR    # CPU, interpreter, tiny shapes

Needs no pytest, no venv and no ``datasets`` (the GPU machine has none): torch, triton,
transformers, numpy and numba. Three checks, each recorded even when it fails (its error as
text), in ``DIR/gpu_checks.json`` (format ``dflash-prep/gpu-checks`` v1):

- ``causal``: the varlen and padded causal kernels (and one non-causal padded case), forward and
  the three gradients, against the fp32 reference with FlashAttention's rule (error <= 2x the
  same-precision PyTorch error plus a small floor) and bitwise equal across two runs;
- ``dflash``: the DFlash kernels, forward and the five gradients, the same rule, full
  attention and a sliding window (``bench.attention_dflash.correctness``);
- ``trainer``: a small DFlash drafter on a random Qwen3 target, trained for a few optimizer
  steps with the trainer's own ``train_step`` (bf16 autocast and the Triton kernels on CUDA;
  the reference backend in ``--smoke``): every loss finite, and the loss of one batch through
  the Triton kernels within 2% of the reference backend's (CUDA only: ``--smoke`` skips it,
  ``compared`` false), with full attention and with a sliding window.

Exit status 1 when a check fails. ``--smoke`` runs the same code on CPU (no verdict on speed;
the checks themselves still mean what they say).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

FORMAT = "dflash-prep/gpu-checks"
FLOOR = {"torch.float32": 1e-5, "torch.float16": 1e-4, "torch.bfloat16": 1e-3}


def compare(got, ref, same) -> dict:
    """FlashAttention's rule in max norm: |got - ref| <= 2 |same - ref| + floor (numbers kept)."""
    got, ref_f, same_f = got.float(), ref.float(), same.float()
    err = float((got - ref_f).abs().max()) if got.numel() else 0.0
    err_same = float((same_f - ref_f).abs().max()) if got.numel() else 0.0
    floor = FLOOR.get(str(same.dtype), 1e-5) * max(1.0, float(ref_f.abs().max()) if ref_f.numel() else 1.0)
    bound = 2.0 * err_same + floor
    return dict(err=err, err_same_precision=err_same, bound=bound, passed=bool(err <= bound and math.isfinite(err)))


def _run(fn, q, k, v, do, *meta, **kw):
    import torch

    xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fn(*xs, *meta, **kw)
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def check_causal(device, smoke: bool) -> list[dict]:
    """Varlen and padded causal kernels (and a non-causal padded case) vs the references."""
    import torch

    from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend
    from dflash_prep.kernels.reference import attention_padded_reference, attention_varlen_reference

    g = torch.Generator().manual_seed(0)
    docs = [1, 17, 0, 40] if smoke else [1, 17, 0, 63, 130, 256, 1000, 1500]
    rows = [40, 0, 17] if smoke else [1024, 0, 700, 1]
    dims = (32,) if smoke else (64, 128)
    out = []
    for d in dims:
        for layout, causal in (("varlen", True), ("padded", True), ("padded", False)):
            hq, hkv = (4, 2) if smoke else (8, 2)
            if layout == "varlen":
                t = sum(docs)
                shape_q, shape_k = (t, hq, d), (t, hkv, d)
                cu = torch.tensor([0, *docs], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
                meta, fn, ref_fn = (cu, max(docs)), attention_varlen, attention_varlen_reference
            else:
                seq = max(rows)
                shape_q, shape_k = (len(rows), hq, seq, d), (len(rows), hkv, seq, d)
                meta = (torch.tensor(rows, dtype=torch.int32).to(device),)
                fn, ref_fn = attention_padded, attention_padded_reference
            q, do = (torch.randn(shape_q, generator=g).to(device, torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(shape_k, generator=g).to(device, torch.bfloat16) for _ in range(2))
            with force_backend("triton"):
                got = _run(fn, q, k, v, do, *meta, causal=causal)
                again = _run(fn, q, k, v, do, *meta, causal=causal)
            ref = _run(ref_fn, q.float(), k.float(), v.float(), do.float(), *meta, causal=causal)
            same = _run(ref_fn, q, k, v, do, *meta, causal=causal, upcast=False)
            grads = {n: compare(a, r, s) for n, a, r, s in zip(("o", "dq", "dk", "dv"), got, ref, same)}
            det = all(torch.equal(a, b) for a, b in zip(got, again))
            out.append(dict(layout=layout, causal=causal, head_dim=d, deterministic=det, grads=grads,
                            passed=det and all(x["passed"] for x in grads.values())))
    return out


def check_dflash(device, smoke: bool) -> list[dict]:
    """The DFlash kernels vs the reference, full attention and sliding windows (bench.attention_dflash's check)."""
    import torch

    from dflash_prep.bench.attention_dflash import DFlashBenchConfig, correctness, make_case, smoke_config

    cfg = smoke_config("unused") if smoke else DFlashBenchConfig()
    cases = [(40, 5, 8)] if smoke else [(1024, 64, 256), (3072, 256, 1024)]
    out = []
    for s, n, w in cases:
        leaves, meta = make_case(cfg, s, n, device)
        do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
        for window in (0, w):
            out.append(dict(S=s, N=n, **correctness(leaves, meta, cfg.block_size, do, window=window)))
    return out


def check_trainer(device, smoke: bool) -> dict:
    """A few DFlash ``train_step`` calls on ``device`` with full and windowed attention."""
    import torch

    from dflash_prep.bench import drafter_gpu as g
    from dflash_prep.kernels.attention import force_backend
    from dflash_prep.objectives.drafter_cost import DrafterCostModel
    from dflash_prep.train import distributed
    from dflash_prep.train.data import StepBatches
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
    from dflash_prep.train.loop import _autocast_for, train_step
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, default_gamma
    from dflash_prep.train.optim import build_optimizer

    dims = dict(g.SMOKE, head_dim=32, n=200, scale=64, budget=256) if smoke else dict(g.SMOKE, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                                           vocab=4096, n=600, scale=4, budget=8192)
    cfg = g.GpuBenchConfig(**{**dims, "device": device.type})
    lens, mc = g.inputs(cfg)
    cost = DrafterCostModel(hidden=cfg.hidden, layers=cfg.layers, intermediate=cfg.intermediate, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab)
    mbs = g.ours_microbatches(cfg, lens, mc, cost)[:2 if smoke else 3]  # optimizer steps
    ds = g.SyntheticMasks(lens, mc.supervised, cfg.vocab, cfg.seed)
    taps = build_target_layer_ids(cfg.layers, 1)
    target, hc = g.build_target(cfg, device, taps)
    tc = g.objective_config(device.type)
    autocast = _autocast_for(device, True)
    dist = distributed.Dist(0, 1, 0, device)
    runs = {}
    for window in (0, 2 * g.B):
        torch.manual_seed(0)
        dcfg = DrafterConfig.from_target_config(hc, 1, g.B, cfg.vocab - 1, target_layer_ids=taps, sliding_window=window)
        spec = AnchorSpec(seed=cfg.seed, max_anchors=8 if smoke else g.MAX_ANCHORS, policy="cap", block_size=g.B)
        obj = DFlashObjective(Drafter(dcfg).to(device), target, tc, anchor_spec=spec, gamma=default_gamma(g.B),
                              identity={})
        batches = [obj.build(ds, SimpleNamespace(sample_ids=m, step=i, rank=0, accum=0), 0, "varlen",
                             device.type == "cuda") for i, m in enumerate(mbs)]
        with torch.no_grad():
            first = batches[0].to(device)
            loss = {}
            for name, backend in (("triton", "reference" if smoke else "triton"), ("reference", "reference")):
                with force_backend(backend):  # --smoke: the interpreter is too slow for a whole loss
                    ls, _ = obj.loss(first, autocast)
                loss[name] = float(ls) / max(first.weight_sum, 1e-12)
        opt = build_optimizer(obj.model, tc)
        losses = []
        with force_backend("reference" if smoke else "triton"):  # the interpreter is too slow for steps
            for i, b in enumerate(batches):
                st = train_step(obj.model, opt, StepBatches(0, i, [b]), lr=1e-3, grad_clip=1.0, d=dist,
                                autocast=autocast, objective=obj)
                losses.append(float(st["loss"]))
        rel = abs(loss["triton"] - loss["reference"]) / max(abs(loss["reference"]), 1e-12)
        runs[f"window {window}" if window else "full"] = dict(
            window=window, step_losses=losses, loss_triton=loss["triton"], loss_reference=loss["reference"],
            rel_diff=rel, compared=not smoke, passed=bool(all(math.isfinite(x) for x in losses) and rel <= 2e-2))
    return dict(runs=runs, passed=all(r["passed"] for r in runs.values()))


CHECKS = {"causal": check_causal, "dflash": check_dflash, "trainer": check_trainer}


def run(out: Path, smoke: bool) -> dict:
    """Every check (a failing one records its error), then ``out/gpu_checks.json``; returns the report."""
    import torch

    from dflash_prep.formats.fileio import atomic_write_json

    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    report = dict(smoke=smoke, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, checks={})
    for name, fn in CHECKS.items():
        t0 = time.perf_counter()
        try:
            res = fn(device, smoke)
            passed = all(r["passed"] for r in res) if isinstance(res, list) else res["passed"]
            entry = dict(passed=passed, result=res)
        except Exception as e:  # recorded, the other checks still run
            entry = dict(passed=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["checks"][name] = entry
        print(f"gpu_checks {name}: {'ok' if entry['passed'] else 'FAILED'} ({entry['seconds']} s)", flush=True)
        atomic_write_json(out / "gpu_checks.json", report, format=FORMAT, version=1)  # a cut run keeps what it has
    report["passed"] = all(c["passed"] for c in report["checks"].values())
    atomic_write_json(out / "gpu_checks.json", report, format=FORMAT, version=1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.gpu_checks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_checks.json")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the @triton.jit kernels
    import torch

    if not a.smoke and not torch.cuda.is_available():
        print("bench.gpu_checks: no CUDA GPU here; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    return 0 if run(a.out, a.smoke)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

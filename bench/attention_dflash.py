"""GPU check of the DFlash attention kernels: correctness against the reference, and speed
against FlexAttention (compiled, equivalent BlockMask) and SDPA (dense boolean mask).

    PYTHONPATH=. python3 -m dflash_prep.bench.attention_dflash --out results/   # GPU, <= 3 minutes
    PYTHONPATH=. python3 -m dflash_prep.bench.attention_dflash --smoke --out /tmp/x  # CPU, interpreter, seconds

Runs with a bare python3 that has torch and triton (no venv, no pip): it imports only the
standard library, torch, triton, ``dflash_prep.kernels`` and ``bench.attention``'s timer.

Cases: bf16, B = 16, Hq/Hkv = 32/8, D = 128, context S in {1024, 3072, 8192} x anchors N in
{64, 256, 512}. Each case packs three documents back to back: (S, N), (S/4, N/4) and
(S/8, 0) (a document without anchors); anchors are distinct positions in ``[0, S_d)``,
sorted, drawn from a seeded generator. Per case:

- correctness: forward and all five gradients of ours against the fp32 reference, with
  FlashAttention's rule (error <= 2x the error of the bf16 reference, plus a small floor);
  outputs must be bitwise equal across two runs;
- timing (``triton.testing.do_bench`` mean ms, forward with autograd recording, backward
  alone) of ours, of ``flex_attention`` compiled with the equivalent ``BlockMask`` (built
  outside the timed region) over keys ``[all context | all draft rows]``, and of SDPA with a
  dense boolean mask of the same layout (GQA heads expanded beforehand, the math backend
  excluded). A baseline that fails (e.g. out of memory) records its error instead.

Sliding window (issue 23): at a long context (32K context, 512 anchors, B = 16, W = 2048)
ours with full attention and ours with the window, forward and backward, on the same inputs;
the window's speed-up is the ratio of the times (the kernels skip key tiles outside every
window, so the cost should fall towards ``min(a_j, W)`` keys per block). Its correctness is
checked against the reference (window W_check) on the first main case.

FLOPs as issue 15 counts them: forward ``4 * Hq * D * sum_blocks B * (a_j + B)``, backward
2.5x that (windowed rows: ``min(a_j, W)`` in place of ``a_j``). Targets, as ratios in one run: forward >= 1.2x Flex, backward >= 1.0x Flex. Cases
run in priority order; after ``budget_s`` seconds the baselines are skipped (and say so),
because every Flex shape compiles anew. ``--smoke`` runs tiny shapes on CPU through the Triton
interpreter (Flex eagerly, forward only); its numbers are not performance figures and no
target is evaluated. Writes ``<out>/attention-dflash[-smoke].json`` (format
``dflash-attention-dflash-bench`` v1) and a markdown table beside it, atomically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "dflash-attention-dflash-bench"
VERSION = 1
NAMES = ("o", "dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk")
FLOOR = 1e-3  # bf16: allowed error floor relative to the reference's magnitude (as tests/kernels/helpers.py)


@dataclass(frozen=True)
class DFlashBenchConfig:
    """What to run; :func:`smoke_config` gives the CPU variant."""

    out: str = "results"
    """Folder for the JSON and the markdown table."""
    smoke: bool = False
    """Tiny CPU shapes through the interpreter; no timing claims, no targets."""
    cases: tuple[tuple[int, int], ...] = ((3072, 512), (8192, 512), (1024, 256), (3072, 256), (8192, 256),
                                          (1024, 64), (3072, 64), (8192, 64), (1024, 512))
    """(S, N) of the main document, in priority order (the baselines may run out of budget)."""
    block_size: int = 16
    """B: draft tokens per block."""
    heads_q: int = 32
    """Query heads."""
    heads_kv: int = 8
    """Key/value heads (GQA)."""
    head_dim: int = 128
    """D."""
    seed: int = 0
    """Seed of the anchors and the random inputs."""
    budget_s: float = 100.0
    """After this many seconds, baselines (Flex, SDPA) are skipped; ours and the checks still run."""
    window_cases: tuple[tuple[int, int, int], ...] = ((32768, 512, 2048),)
    """(S, N, W): ours full vs ours with sliding window W on the same inputs."""
    window_check: int = 1024
    """Sliding window of the extra correctness check on the first case (0: none)."""

    def __post_init__(self) -> None:
        from dflash_prep.errors import ConfigError

        for s, n in self.cases:
            if not (0 < n <= s):
                raise ConfigError(f"case (S={s}, N={n}): need 0 < N <= S (N distinct anchors in [0, S))")
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise ConfigError(f"heads_q={self.heads_q} must be a multiple of heads_kv={self.heads_kv}")
        if self.budget_s <= 0:
            raise ConfigError(f"budget_s must be > 0, got {self.budget_s}")
        for s, n, w in self.window_cases:
            if not (0 < n <= s and w >= self.block_size):
                raise ConfigError(f"window case (S={s}, N={n}, W={w}): need 0 < N <= S and W >= B={self.block_size}")
        if 0 < self.window_check < self.block_size:
            raise ConfigError(f"window_check={self.window_check} must be 0 or >= B={self.block_size}")


def smoke_config(out: str) -> DFlashBenchConfig:
    return DFlashBenchConfig(out=out, smoke=True, cases=((40, 5),), block_size=4, heads_q=2, heads_kv=1,
                             head_dim=32, budget_s=600, window_cases=((64, 6, 8),), window_check=8)


def documents(s: int, n: int) -> list[tuple[int, int]]:
    """(S_d, N_d) of a case's packed documents: the main one, a quarter one, one without anchors."""
    return [(s, n), (max(1, s // 4), n // 4), (max(1, s // 8), 0)]


def dflash_flops(anchors, heads_q: int, head_dim: int, block_size: int, window: int = 0) -> int:
    """Forward FLOPs: 4 * Hq * D * sum_j B * (a_j + B), ``min(a_j, W)`` under a window (exact int)."""
    seen = (int(a) if window == 0 else min(int(a), window) for a in anchors)
    return 4 * heads_q * head_dim * sum(block_size * (a + block_size) for a in seen)


# ----------------------------------------------------------------------------- inputs
def make_case(cfg: DFlashBenchConfig, s: int, n: int, device):
    """Leaf tensors (q, k_ctx, v_ctx, k_blk, v_blk), the offsets and anchors, all on ``device``."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + s * 1009 + n)
    docs = documents(s, n)
    anchors = [torch.randperm(sd, generator=g)[:nd].sort().values for sd, nd in docs]
    cu_ctx = torch.tensor([0] + [sd for sd, _ in docs], dtype=torch.int64).cumsum(0).to(torch.int32)
    cu_blk = torch.tensor([0] + [nd * cfg.block_size for _, nd in docs], dtype=torch.int64).cumsum(0).to(torch.int32)
    rows, ctx = int(cu_blk[-1]), int(cu_ctx[-1])

    def rnd(t, h):
        return torch.randn(t, h, cfg.head_dim, generator=g).to(device, torch.bfloat16).requires_grad_()

    leaves = [rnd(rows, cfg.heads_q), rnd(ctx, cfg.heads_kv), rnd(ctx, cfg.heads_kv),
              rnd(rows, cfg.heads_kv), rnd(rows, cfg.heads_kv)]
    meta = [cu_ctx.to(device), cu_blk.to(device), torch.cat(anchors).to(torch.int32).to(device)]
    return leaves, meta


def dense_layout(meta, rows: int, ctx: int, block_size: int):
    """Per draft row: the allowed key interval ``[lo, hi)`` among the context rows, and its block.

    Keys are laid out ``[all context rows | all draft rows]``; row ``r`` sees context keys
    ``lo[r] <= kv < hi[r]`` (its document's ``[0, a_j)``) and draft keys of block ``r // B``.
    """
    import torch

    cu_ctx, cu_blk, anchors = meta
    blocks = torch.arange(rows, device=anchors.device) // block_size  # (rows,)
    doc = torch.searchsorted(cu_blk.to(torch.int64), torch.arange(rows, device=anchors.device), right=True) - 1
    lo = cu_ctx.to(torch.int64)[doc]
    return lo, lo + anchors.to(torch.int64)[blocks], blocks


def _flex(meta, rows: int, ctx: int, block_size: int, device, compiled: bool):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lo, hi, blocks = dense_layout(meta, rows, ctx, block_size)

    def dflash_mask(b, h, q_idx, kv_idx):
        in_ctx = (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])
        own = (kv_idx >= ctx) & ((kv_idx - ctx) // block_size == blocks[q_idx])
        return in_ctx | own

    mask = create_block_mask(dflash_mask, None, None, rows, ctx + rows, device=str(device), _compile=compiled)
    attn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def make(q, k, v):  # q (1, Hq, rows, D), k/v (1, Hkv, ctx + rows, D)
        return lambda: attn(q, k, v, block_mask=mask, enable_gqa=True)
    return make


def _sdpa_dense(meta, rows: int, ctx: int, block_size: int):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lo, hi, blocks = dense_layout(meta, rows, ctx, block_size)
    kv = torch.arange(ctx + rows, device=lo.device)
    mask = ((kv[None, :] >= lo[:, None]) & (kv[None, :] < hi[:, None])) | (
        (kv[None, :] >= ctx) & ((kv[None, :] - ctx) // block_size == blocks[:, None]))  # (rows, ctx + rows)
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] if lo.is_cuda else [SDPBackend.MATH]

    def make(q, k, v):  # (1, Hq, rows, D) each: GQA heads expanded beforehand
        def fwd():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return fwd
    return make


# ----------------------------------------------------------------------------- checks
def _grads(fn, leaves, meta, block_size, do, **kw):
    import torch

    xs = [t.detach().clone().requires_grad_() for t in leaves]
    o = fn(*xs, *meta, block_size, **kw)
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def correctness(leaves, meta, block_size, do, window: int = 0) -> dict:
    """Ours vs the fp32 reference, with the bf16 reference's error as the yardstick; + determinism."""
    import torch

    from dflash_prep.kernels.attention import attention_dflash, force_backend
    from dflash_prep.kernels.dflash_reference import attention_dflash_reference

    with force_backend("triton"):
        ours = _grads(attention_dflash, leaves, meta, block_size, do, window=window)
        again = _grads(attention_dflash, leaves, meta, block_size, do, window=window)
    wide = [t.detach().float() for t in leaves]
    ref = _grads(attention_dflash_reference, wide, meta, block_size, do.float(), window=window)
    same = _grads(attention_dflash_reference, leaves, meta, block_size, do, upcast=False, window=window)
    out = dict(window=window, deterministic=all(torch.equal(a, b) for a, b in zip(ours, again)), grads={})
    for name, g, r, s in zip(NAMES, ours, ref, same):
        err = float((g.float() - r).abs().max()) if g.numel() else 0.0
        err_same = float((s.float() - r).abs().max()) if g.numel() else 0.0
        bound = 2.0 * err_same + FLOOR * max(1.0, float(r.abs().max()) if r.numel() else 1.0)
        out["grads"][name] = dict(err=err, err_same_precision=err_same, bound=bound, passed=err <= bound)
    out["passed"] = out["deterministic"] and all(v["passed"] for v in out["grads"].values())
    del ours, again, ref, same
    return out


# ----------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, cfg: DFlashBenchConfig):
        import torch

        from dflash_prep.bench.attention import Timer

        self.cfg = cfg
        self.cuda = torch.cuda.is_available() and not cfg.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.timer = Timer(self.cuda)
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.window_rows: list[dict] = []
        self.checks: list[dict] = []

    def _time(self, base: dict, provider: str, fn_maker, inputs, *, ours: bool, ref=None, note=None):
        from dflash_prep.bench.attention import timed_row

        spent = not ours and time.perf_counter() - self.t0 > self.cfg.budget_s
        skip = f"skipped: time budget {self.cfg.budget_s:.0f}s spent" if spent else None
        row, out = timed_row(self.timer, base, provider, fn_maker, inputs, ours=ours, skip=skip, ref=ref, note=note)
        self.rows.append(row)
        return out

    def case(self, s: int, n: int) -> None:
        import torch

        from dflash_prep.kernels.attention import attention_dflash, force_backend

        cfg, bsz = self.cfg, self.cfg.block_size
        leaves, meta = make_case(cfg, s, n, self.device)
        rows, ctx = leaves[0].shape[0], leaves[1].shape[0]
        base = dict(S=s, N=n, docs=documents(s, n), rows=rows, ctx=ctx,
                    flops_fwd=dflash_flops(meta[2].tolist(), cfg.heads_q, cfg.head_dim, bsz))
        do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(cfg.seed)).to(self.device, torch.bfloat16)
        self.checks.append(dict(S=s, N=n, **correctness(leaves, meta, bsz, do)))
        if cfg.window_check and (s, n) == cfg.cases[0]:
            self.checks.append(dict(S=s, N=n, **correctness(leaves, meta, bsz, do, window=cfg.window_check)))

        def ours(*xs):
            def fwd():
                with force_backend("triton"):
                    return attention_dflash(*xs, *meta, bsz)
            return fwd

        out = self._time(base, "ours", ours, leaves, ours=True)
        ref = out.transpose(0, 1).unsqueeze(0)  # (1, Hq, rows, D)
        q4 = leaves[0].detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
        k4, v4 = (torch.cat([c.detach(), b.detach()]).transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
                  for c, b in ((leaves[1], leaves[3]), (leaves[2], leaves[4])))  # (1, Hkv, ctx + rows, D)
        if self.cuda:
            self._time(base, "flex-blockmask", lambda *xs: _flex(meta, rows, ctx, bsz, self.device, True)(*xs),
                       [q4, k4, v4], ours=False, ref=ref)
        else:  # Flex has no CPU backward: its eager forward only, so the code path is exercised
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                got = _flex(meta, rows, ctx, bsz, self.device, False)(q4.detach(), k4.detach(), v4.detach())()
            self.rows.append(dict(base, provider="flex-blockmask", fwd_ms=None, bwd_ms=None, fwd_tflops=None,
                                  bwd_tflops=None, max_abs_diff=float((got.float() - ref.float()).abs().max()),
                                  error=None, note="CPU smoke: eager forward only"))
        group = cfg.heads_q // cfg.heads_kv
        k_rep, v_rep = (t.detach().repeat_interleave(group, 1).requires_grad_() for t in (k4, v4))
        self._time(base, "sdpa-dense-mask", lambda *xs: _sdpa_dense(meta, rows, ctx, bsz)(*xs),
                   [q4, k_rep, v_rep], ours=False, ref=ref)
        del leaves, q4, k4, v4, k_rep, v_rep
        if self.cuda:
            torch.cuda.empty_cache()

    def window_case(self, s: int, n: int, w: int) -> None:
        """Ours with full attention, then with sliding window ``w``, on the same inputs."""
        import torch

        from dflash_prep.bench.attention import timed_row
        from dflash_prep.kernels.attention import attention_dflash, force_backend

        cfg, bsz = self.cfg, self.cfg.block_size
        leaves, meta = make_case(cfg, s, n, self.device)
        anchors = meta[2].tolist()
        for window in (0, w):
            base = dict(S=s, N=n, W=window, docs=documents(s, n), rows=leaves[0].shape[0], ctx=leaves[1].shape[0],
                        flops_fwd=dflash_flops(anchors, cfg.heads_q, cfg.head_dim, bsz, window))

            def make(*xs, window=window):
                def fwd():
                    with force_backend("triton"):
                        return attention_dflash(*xs, *meta, bsz, window=window)
                return fwd

            name = "ours" if window == 0 else f"ours window {window}"
            self.window_rows.append(timed_row(self.timer, base, name, make, leaves, ours=True)[0])
        del leaves
        if self.cuda:
            torch.cuda.empty_cache()


def window_speedups(rows: list[dict]) -> list[dict]:
    """Per window case: full / windowed time, forward and backward."""
    out = []
    for r in rows:
        if r["W"] == 0:
            continue
        full = next(f for f in rows if f["W"] == 0 and (f["S"], f["N"]) == (r["S"], r["N"]))
        out.append(dict(S=r["S"], N=r["N"], W=r["W"],
                        fwd_speedup=full["fwd_ms"] / r["fwd_ms"] if r["fwd_ms"] else None,
                        bwd_speedup=full["bwd_ms"] / r["bwd_ms"] if r["bwd_ms"] else None,
                        flops_ratio=full["flops_fwd"] / r["flops_fwd"]))
    return out


def evaluate_targets(rows: list[dict], cfg: DFlashBenchConfig) -> list[dict]:
    """Per case with a Flex time: ours / Flex TFLOP/s, forward (bar 1.2) and backward (bar 1.0)."""
    out = []
    for s, n in cfg.cases:
        pick = {r["provider"]: r for r in rows if r["S"] == s and r["N"] == n}
        for field, bar in (("fwd_tflops", 1.2), ("bwd_tflops", 1.0)):
            a, b = (pick.get(p, {}).get(field) for p in ("ours", "flex-blockmask"))
            ratio = None if a is None or b is None else a / b
            out.append(dict(target=f"{field[:3]} vs flex-blockmask", S=s, N=n, ratio=ratio, bar=bar,
                            passed=None if (cfg.smoke or ratio is None) else bool(ratio >= bar)))
    return out


def markdown(report: dict) -> str:
    from dflash_prep.bench.attention import fmt

    lines = [f"# DFlash attention check ({report['device']}, {report['created'][:10]})", ""]
    if report["smoke"]:
        lines += ["**Smoke run on CPU: times are not performance figures.**", ""]
    c = report["config"]
    lines += [f"Command: `{report['command']}`; torch {report['torch']}, triton {report['triton']}; bf16, "
              f"B={c['block_size']}, Hq/Hkv={c['heads_q']}/{c['heads_kv']}, D={c['head_dim']}; "
              "max abs diff: output against ours.", "",
              "| S | N | provider | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | max abs diff | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['S']} | {r['N']} | {r['provider']} | {fmt(r['fwd_ms'], '.3f')} | "
                     f"{fmt(r['bwd_ms'], '.3f')} | {fmt(r['fwd_tflops'])} | {fmt(r['bwd_tflops'])} | "
                     f"{fmt(r['max_abs_diff'], '.2e')} | {r['error'] or r['note'] or ''} |")
    lines += ["", "Sliding window: ours with full attention and with window W, same inputs.", "",
              "| S | N | W | fwd ms | bwd ms | fwd speed-up | bwd speed-up | FLOPs ratio |", "|---|---|---|---|---|---|---|---|"]
    ups = {(u["S"], u["N"], u["W"]): u for u in report["window_speedups"]}
    for r in report["window_rows"]:
        u = ups.get((r["S"], r["N"], r["W"]), {})
        lines.append(f"| {r['S']} | {r['N']} | {r['W'] or 'full'} | {fmt(r['fwd_ms'], '.3f')} | {fmt(r['bwd_ms'], '.3f')} | "
                     f"{fmt(u.get('fwd_speedup'), '.2f')} | {fmt(u.get('bwd_speedup'), '.2f')} | "
                     f"{fmt(u.get('flops_ratio'), '.2f')} |")
    lines += ["", "| S | N | W | correct (6 tensors, 2x rule) | deterministic | worst err / bound |",
              "|---|---|---|---|---|---|"]
    for ch in report["checks"]:
        worst = max(ch["grads"].values(), key=lambda g: g["err"] / g["bound"])
        lines.append(f"| {ch['S']} | {ch['N']} | {ch['window'] or 'full'} | {'yes' if ch['passed'] else '**no**'} | "
                     f"{'yes' if ch['deterministic'] else '**no**'} | {worst['err']:.2e} / {worst['bound']:.2e} |")
    lines += ["", "| target | S | N | ratio | bar | pass |", "|---|---|---|---|---|---|"]
    for t in report["targets"]:
        verdict = "-" if t["passed"] is None else ("yes" if t["passed"] else "**no**")
        lines.append(f"| {t['target']} | {t['S']} | {t['N']} | {fmt(t['ratio'], '.2f')} | >= {t['bar']} | {verdict} |")
    return "\n".join(lines) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, then rename it into place (no numpy needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # only when the write or the rename failed
            os.unlink(tmp)


def read_report(path: str | os.PathLike) -> dict:
    """Load a report, checking its format name and version."""
    from dflash_prep.errors import InputError

    report = json.loads(Path(path).read_text())
    if report.get("format") != FORMAT or report.get("version") != VERSION:
        raise InputError(f"{path}: not a {FORMAT} v{VERSION} file (format={report.get('format')!r}, "
                         f"version={report.get('version')!r}); rerun python -m dflash_prep.bench.attention_dflash")
    return report


def run(cfg: DFlashBenchConfig) -> dict:
    """Run every case; write ``attention-dflash[-smoke].json`` + ``.md`` under ``cfg.out``; return the report."""
    import torch
    import triton

    if hasattr(torch, "_dynamo"):  # one Flex compile per shape: keep them all compiled
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    runner = Runner(cfg)
    for s, n in cfg.cases:
        runner.case(s, n)
    for s, n, w in cfg.window_cases:
        runner.window_case(s, n, w)
    report = dict(
        format=FORMAT, version=VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command="python3 -m dflash_prep.bench.attention_dflash" + (" --smoke" if cfg.smoke else ""),
        device=torch.cuda.get_device_name() if runner.cuda else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, smoke=cfg.smoke,
        elapsed_s=round(time.perf_counter() - runner.t0, 1), config=asdict(cfg),
        rows=runner.rows, checks=runner.checks, targets=evaluate_targets(runner.rows, cfg),
        window_rows=runner.window_rows, window_speedups=window_speedups(runner.window_rows),
    )
    stem = "attention-dflash-smoke" if cfg.smoke else "attention-dflash"
    out = Path(cfg.out)
    _atomic_write(out / f"{stem}.json", (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    _atomic_write(out / f"{stem}.md", markdown(report).encode())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.attention_dflash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    parser.add_argument("--out", default="results", help="results folder (default: results/)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip baselines after this many seconds")
    parser.add_argument("--cases", default=None, help="main cases S:N,S:N,... in priority order (default: all nine)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the @triton.jit kernels
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench.attention_dflash: no CUDA GPU here; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    cfg = smoke_config(args.out) if args.smoke else DFlashBenchConfig(out=args.out)
    if args.budget_s is not None:
        cfg = DFlashBenchConfig(**{**asdict(cfg), "budget_s": args.budget_s})
    if args.cases:
        cases = tuple(tuple(int(x) for x in c.split(":")) for c in args.cases.split(","))
        cfg = DFlashBenchConfig(**{**asdict(cfg), "cases": cases})
    report = run(cfg)
    print(markdown(report))
    bad = [c for c in report["checks"] if not c["passed"]]
    if bad:
        print(f"{len(bad)} case(s) failed the correctness check; see the table above", file=sys.stderr)
        return 1
    missed = [t for t in report["targets"] if t["passed"] is False]
    if missed:
        print(f"{len(missed)} target(s) missed; see the table above", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

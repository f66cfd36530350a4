"""Kernel benchmark: our Triton attention against torch SDPA and FlexAttention, one GPU, one run.

    python -m dflash_prep.bench.attention [--out results/]   # on a GPU, at most ~5 minutes
    python -m dflash_prep.bench.attention --smoke            # CPU: tiny shapes through the interpreter

What it measures (bf16, causal), each provider on the same GPU in the same process:

- dense: D in {64, 128}, L in {1k, 2k, 4k, 8k, 16k}, B = 16k / L rows (16k tokens per
  batch), H = 2048 / D heads. Providers: ours (``attention_padded``, full rows), SDPA with
  the flash backend, SDPA with the cuDNN backend.
- varlen: documents drawn from the ``seedlike`` length profile (dflash_prep.synth.profiles)
  until they fill 16k tokens, packed. Providers: ours (``attention_varlen``),
  FlexAttention with a causal document mask (compiled; the block mask is built outside
  the timed region), and ours on a dense batch of about the same FLOPs (every row
  ``L_eq = sum(L^2)/sum(L)`` long), to show that packing costs no throughput.

FLOPs follow definitions.md: forward ``4 * H * sum(L^2) * D * 0.5`` (causal), backward 2.5x the
forward. Forward is timed with autograd recording (a training forward); backward times
``o.backward(dO)`` alone. GPU times are ``triton.testing.do_bench`` means (warm-up
included, caches flushed, our autotuning done before timing). A baseline that cannot run
(for example cuDNN attention missing) gets its error recorded instead of a number.

Targets checked, as ratios in one run: forward >= 1.0x SDPA-flash, backward >= 0.8x
SDPA-flash, varlen >= 1.0x FlexAttention, varlen >= 0.9x the equal-FLOPs dense run.

``--smoke`` runs the same code on tiny shapes on CPU (Triton interpreter, SDPA math,
eager Flex forward) to prove it executes; its times are not performance figures and it
evaluates no target. Outputs: ``<out>/kernels-bench[-smoke].json`` (format
``dflash-kernels-bench`` v1) and a markdown table beside it, both written atomically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "dflash-kernels-bench"
VERSION = 1
REF_TOKENS = 16384  # the profile's lengths are scaled by tokens / REF_TOKENS


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``smoke_config()`` gives the CPU variant."""

    out: str = "results"
    """Folder for the JSON and the markdown table."""
    smoke: bool = False
    """Tiny CPU shapes, no timing claims, no target evaluation."""
    head_dims: tuple[int, ...] = (64, 128)
    """Head dims D to sweep."""
    seqlens: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384)
    """Dense sequence lengths L; each must divide ``tokens``."""
    tokens: int = 16384
    """Tokens per batch (dense: B = tokens / L; varlen: documents fill exactly this)."""
    hidden: int = 2048
    """Model width: heads H = hidden / D."""
    profile: str = "seedlike"
    """Length profile the varlen documents are drawn from."""
    seed: int = 0
    """Seed of the varlen document lengths and of the random inputs."""
    budget_s: float = 270.0
    """Cases still pending after this many seconds are skipped (and say so)."""

    def __post_init__(self) -> None:
        from dflash_prep.errors import ConfigError

        for d in self.head_dims:
            if self.hidden % d:
                raise ConfigError(f"hidden={self.hidden} is not a multiple of head dim {d}")
        for length in self.seqlens:
            if length <= 0 or self.tokens % length:
                raise ConfigError(f"seqlen {length} must divide tokens={self.tokens} (B = tokens / L)")
        if self.budget_s <= 0:
            raise ConfigError(f"budget_s must be > 0, got {self.budget_s}")


def smoke_config(out: str) -> BenchConfig:
    return BenchConfig(out=out, smoke=True, head_dims=(32,), seqlens=(32, 64), tokens=64, hidden=64, budget_s=600)


def causal_flops(doc_lens, heads: int, head_dim: int) -> int:
    """Forward FLOPs of causal attention over documents: 4 * H * sum(L^2) * D * 0.5 (exact int)."""
    return 2 * heads * head_dim * sum(int(n) * int(n) for n in doc_lens)


def varlen_doc_lens(cfg: BenchConfig) -> list[int]:
    """Document lengths that fill exactly ``cfg.tokens``: profile draws, scaled, last one cut."""
    from dflash_prep.synth.profiles import make_lengths

    draws = make_lengths(cfg.profile, n=max(64, 8 * cfg.tokens // 65), seed=cfg.seed)
    factor = cfg.tokens / REF_TOKENS
    out, total = [], 0
    for x in draws:
        n = max(1, int(round(float(x) * factor)))
        n = min(n, cfg.tokens - total)
        out.append(n)
        total += n
        if total == cfg.tokens:
            return out
    raise RuntimeError("profile draws did not fill the batch")  # cannot happen: n >= 1 each


# ----------------------------------------------------------------------------- timing
class Timer:
    """GPU: ``triton.testing.do_bench`` mean ms. CPU (smoke): one wall-clock call."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __call__(self, fn, grad_to_none=None) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _measure(timer: Timer, fwd, inputs):
    """(fwd_ms, bwd_ms, output) of a closure ``fwd()`` over leaf tensors ``inputs``."""
    import torch

    fwd_ms = timer(fwd)
    out = fwd()
    grad = torch.randn_like(out)
    bwd_ms = timer(lambda: out.backward(grad, retain_graph=True), grad_to_none=list(inputs))
    return fwd_ms, bwd_ms, out.detach()


def timed_row(timer: Timer, base: dict, provider: str, fn_maker, inputs, *, ours: bool, skip: str | None = None,
              ref=None, note=None) -> tuple[dict, object]:
    """One result row (and the forward's output, or None) of ``provider`` on ``inputs``:
    ms and TFLOP/s both ways (``base["flops_fwd"]``, backward 2.5x), the max difference to
    ``ref``. ``skip`` (a reason) records it as skipped, unrun. Our kernel must run, so its
    errors propagate; a baseline's are recorded (its compile or launch may fail in many
    ways: OOM, no kernel for the shape, ...)."""
    import torch

    row = dict(base, provider=provider, fwd_ms=None, bwd_ms=None, fwd_tflops=None, bwd_tflops=None,
               max_abs_diff=None, error=None, note=note)
    if skip:
        row["error"] = skip
        return row, None
    cuda = torch.cuda.is_available() and getattr(timer, "cuda", False)
    try:
        fwd_ms, bwd_ms, out = _measure(timer, fn_maker(*inputs), inputs)
    except Exception as e:
        if ours:
            raise
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if cuda:
            torch.cuda.empty_cache()
        return row, None
    flops = base["flops_fwd"]
    row.update(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2.5 * flops / bwd_ms / 1e9)
    if ref is not None:
        row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
    if cuda:
        torch.cuda.synchronize()
    return row, out


def fmt(x, spec=".1f") -> str:
    """A table cell: ``-`` for a missing number."""
    return "-" if x is None else format(x, spec)


# ----------------------------------------------------------------------------- providers
def _sdpa(backend_name: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(q, k, v):  # (B, H, L, D)
        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return fwd
    return make


def _flex_document(doc_lens, device, compiled: bool):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc_id = torch.repeat_interleave(torch.arange(len(doc_lens), device=device),
                                     torch.tensor(doc_lens, device=device))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    total = int(sum(doc_lens))
    mask = create_block_mask(document_causal, 1, None, total, total, device=str(device))
    attn = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def make(q, k, v):  # (1, H, T, D)
        return lambda: attn(q, k, v, block_mask=mask)
    return make


# ----------------------------------------------------------------------------- cases
class Runner:
    def __init__(self, cfg: BenchConfig):
        import torch

        self.cfg = cfg
        self.cuda = torch.cuda.is_available() and not cfg.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16
        self.timer = Timer(self.cuda)
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.gen = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def _rand(self, *shape):
        import torch

        x = torch.randn(*shape, generator=self.gen, dtype=torch.float32).to(self.device, self.dtype)
        return x.requires_grad_()

    def _over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.cfg.budget_s

    def _record(self, base: dict, provider: str, fn_maker, inputs, *, ours: bool, ref=None, note=None):
        skip = f"skipped: time budget {self.cfg.budget_s:.0f}s spent" if self._over_budget() else None
        row, out = timed_row(self.timer, base, provider, fn_maker, inputs, ours=ours, skip=skip, ref=ref, note=note)
        self.rows.append(row)
        return out

    def dense(self, d: int, seq: int) -> None:
        import torch

        from dflash_prep.kernels.attention import attention_padded, force_backend

        heads, batch = self.cfg.hidden // d, self.cfg.tokens // seq
        base = dict(case="dense", head_dim=d, heads=heads, batch=batch, seqlen=seq,
                    flops_fwd=causal_flops([seq] * batch, heads, d))
        qkv = [self._rand(batch, heads, seq, d) for _ in range(3)]
        lens = torch.full((batch,), seq, dtype=torch.int32, device=self.device)

        def ours(q, k, v):
            def fwd():
                with force_backend("triton"):
                    return attention_padded(q, k, v, lens)
            return fwd

        ref = self._record(base, "sdpa-flash", _sdpa("FLASH_ATTENTION" if self.cuda else "MATH"), qkv, ours=False,
                           note=None if self.cuda else "CPU smoke: the SDPA math backend stands in")
        self._record(base, "sdpa-cudnn", _sdpa("CUDNN_ATTENTION"), qkv, ours=False, ref=ref)
        self._record(base, "ours", ours, qkv, ours=True, ref=ref)

    def varlen(self, d: int) -> None:
        import torch

        from dflash_prep.kernels.attention import attention_padded, attention_varlen, force_backend

        heads, docs = self.cfg.hidden // d, varlen_doc_lens(self.cfg)
        total, flops = sum(docs), causal_flops(docs, heads, d)
        base = dict(case="varlen", head_dim=d, heads=heads, batch=len(docs), seqlen=max(docs),
                    flops_fwd=flops, docs=docs)
        cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(docs), 0)
        cu = cu.to(self.device)
        qkv = [self._rand(total, heads, d) for _ in range(3)]  # (T, H, D)

        def ours(q, k, v):
            def fwd():
                with force_backend("triton"):
                    return attention_varlen(q, k, v, cu, max(docs))
            return fwd

        out = self._record(base, "ours", ours, qkv, ours=True)
        flex_qkv = [t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_() for t in qkv]  # (1,H,T,D)
        ref = out.transpose(0, 1).unsqueeze(0) if out is not None else None
        if self.cuda:
            flex = _flex_document(docs, self.device, compiled=True)
            self._record(base, "flex-document", flex, flex_qkv, ours=False, ref=ref)
        else:  # Flex has no CPU backward: run its forward only, so the code path is exercised
            flex = _flex_document(docs, self.device, compiled=False)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                got = flex(*[t.detach() for t in flex_qkv])()
            self.rows.append(dict(base, provider="flex-document", fwd_ms=None, bwd_ms=None, fwd_tflops=None,
                                  bwd_tflops=None, max_abs_diff=float((got.float() - ref.float()).abs().max()),
                                  error=None, note="CPU smoke: eager forward only (Flex has no CPU backward)"))
        # a dense batch of about the same FLOPs: B_eq rows of L_eq = sum(L^2) / sum(L)
        l_eq = max(1, round(sum(n * n for n in docs) / total))
        b_eq = max(1, round(sum(n * n for n in docs) / (l_eq * l_eq)))
        eq = dict(case="dense-equal-flops", head_dim=d, heads=heads, batch=b_eq, seqlen=l_eq,
                  flops_fwd=causal_flops([l_eq] * b_eq, heads, d))
        eq_qkv = [self._rand(b_eq, heads, l_eq, d) for _ in range(3)]
        lens = torch.full((b_eq,), l_eq, dtype=torch.int32, device=self.device)

        def dense_ours(q, k, v):
            def fwd():
                with force_backend("triton"):
                    return attention_padded(q, k, v, lens)
            return fwd

        self._record(eq, "ours", dense_ours, eq_qkv, ours=True)


def _ratio(rows, num: dict, den: dict, field: str):
    def pick(sel):
        for r in rows:
            if all(r.get(k) == v for k, v in sel.items()) and r.get(field) is not None:
                return r[field]
        return None

    a, b = pick(num), pick(den)
    return None if a is None or b is None else a / b


def evaluate_targets(rows, cfg: BenchConfig) -> list[dict]:
    """One entry per (target, shape): the measured ratio, the bar and whether it passes."""
    out = []
    for d in cfg.head_dims:
        for seq in cfg.seqlens:
            shape = dict(case="dense", head_dim=d, seqlen=seq)
            for field, bar, name in (("fwd_tflops", 1.0, "forward vs sdpa-flash"),
                                     ("bwd_tflops", 0.8, "backward vs sdpa-flash")):
                r = _ratio(rows, dict(shape, provider="ours"), dict(shape, provider="sdpa-flash"), field)
                out.append(dict(target=name, head_dim=d, seqlen=seq, ratio=r, bar=bar))
        for field in ("fwd_tflops", "bwd_tflops"):
            r = _ratio(rows, dict(case="varlen", head_dim=d, provider="ours"),
                       dict(case="varlen", head_dim=d, provider="flex-document"), field)
            out.append(dict(target=f"varlen vs flex-document ({field[:3]})", head_dim=d, seqlen=None, ratio=r, bar=1.0))
            r = _ratio(rows, dict(case="varlen", head_dim=d, provider="ours"),
                       dict(case="dense-equal-flops", head_dim=d, provider="ours"), field)
            out.append(dict(target=f"varlen vs dense equal FLOPs ({field[:3]})", head_dim=d, seqlen=None, ratio=r, bar=0.9))
    for t in out:
        t["passed"] = None if (cfg.smoke or t["ratio"] is None) else bool(t["ratio"] >= t["bar"])
    return out


def markdown(report: dict) -> str:
    lines = [f"# Kernel benchmark ({report['device']}, {report['created'][:10]})", ""]
    if report["smoke"]:
        lines += ["**Smoke run on CPU: times are not performance figures.**", ""]
    lines += [f"Command: `{report['command']}`; torch {report['torch']}, triton {report['triton']}; "
              f"bf16, causal, {report['config']['tokens']} tokens per batch; "
              "max abs diff: output against sdpa-flash (dense) or ours (flex).", "",
              "| case | D | H | B | L (max) | provider | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | max abs diff | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['case']} | {r['head_dim']} | {r['heads']} | {r['batch']} | {r['seqlen']} | {r['provider']} | "
            f"{fmt(r['fwd_ms'], '.3f')} | {fmt(r['bwd_ms'], '.3f')} | {fmt(r['fwd_tflops'])} | "
            f"{fmt(r['bwd_tflops'])} | {fmt(r['max_abs_diff'], '.2e')} | {r['error'] or r['note'] or ''} |")
    lines += ["", "| target | D | L | ratio | bar | pass |", "|---|---|---|---|---|---|"]
    for t in report["targets"]:
        verdict = "-" if t["passed"] is None else ("yes" if t["passed"] else "**no**")
        lines.append(f"| {t['target']} | {t['head_dim']} | {t['seqlen'] or 'varlen'} | {fmt(t['ratio'], '.2f')} | "
                     f">= {t['bar']} | {verdict} |")
    return "\n".join(lines) + "\n"


def run(cfg: BenchConfig) -> dict:
    """Run every case, write ``kernels-bench[-smoke].json`` + ``.md`` under ``cfg.out``; return the report."""
    import torch
    import triton

    from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json

    runner = Runner(cfg)
    for d in cfg.head_dims:  # varlen first: if the time budget runs out, dense lengths go first
        runner.varlen(d)
        for seq in cfg.seqlens:
            runner.dense(d, seq)
    report = dict(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command="python -m dflash_prep.bench.attention" + (" --smoke" if cfg.smoke else ""),
        device=torch.cuda.get_device_name() if runner.cuda else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, smoke=cfg.smoke,
        elapsed_s=round(time.perf_counter() - runner.t0, 1), config=asdict(cfg),
        rows=runner.rows, targets=evaluate_targets(runner.rows, cfg),
    )
    out = Path(cfg.out)
    stem = "kernels-bench-smoke" if cfg.smoke else "kernels-bench"
    atomic_write_json(out / f"{stem}.json", report, format=FORMAT, version=VERSION)
    atomic_write_bytes(out / f"{stem}.md", markdown(report).encode())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_prep.bench.attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    parser.add_argument("--out", default="results", help="results folder (default: results/)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip cases pending after this many seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        # must precede the first import of kernels.flash (the @triton.jit definitions)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench.attention: no CUDA GPU here; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    cfg = smoke_config(args.out) if args.smoke else BenchConfig(out=args.out)
    if args.budget_s is not None:
        cfg = BenchConfig(**{**asdict(cfg), "budget_s": args.budget_s})
    report = run(cfg)
    print(markdown(report))
    failed = [t for t in report["targets"] if t["passed"] is False]
    if failed:
        print(f"{len(failed)} target(s) missed; see the table above", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

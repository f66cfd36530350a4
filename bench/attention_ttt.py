"""GPU check of the EAGLE-3 TTT attention kernels: correctness against the reference, and speed
against torch SDPA with the explicit mask and against the eager PyTorch reference.

    PYTHONPATH=. python3 -m dflash_prep.bench.attention_ttt --out results/           # GPU, about 2-4 minutes
    PYTHONPATH=. python3 -m dflash_prep.bench.attention_ttt --smoke --out /tmp/x     # CPU, interpreter, seconds

Runs with a bare python3 that has torch and triton (no venv, no pip): it imports only the
standard library, torch, triton, ``dflash_prep.kernels`` and ``bench.attention``'s timer.

Cases: bf16, S = 7 steps, Hq/Hkv = 32/8, D = 128, T in {4096, 8192, 16384} packed tokens cut
into rounds of documents of 2048, 1024, 512 and 512 tokens (:func:`documents`). Per case,
forward with autograd recording and backward alone (``triton.testing.do_bench`` mean ms):

- ``ours``: :func:`~dflash_prep.kernels.attention.ttt_attention` on all S steps in one call;
- ``ours-per-step``: the same kernels called once per step the way a TTT loop calls them
  (q of step i, keys/values of steps 0..i), S calls; its output is checked against ``ours``;
- ``sdpa-mask``: torch SDPA (efficient/cuDNN backends) per document over the flattened
  ``(step, token)`` axes with the explicit boolean mask of
  :func:`~dflash_prep.kernels.ttt_reference.ttt_mask` (GQA heads expanded beforehand, masks built
  outside the timed region). Per document because one mask over all T tokens would be
  ``(S*T)^2`` booleans (13 GB at T = 16384) and as many dense scores;
- ``reference``: the eager PyTorch reference (fp32 math, per-document scores), i.e. what
  SpecForge's eager TTT attention computes; it may run out of memory at the larger T, which is
  recorded, as is any baseline's failure.

FLOPs (the useful ones, for every provider, so TFLOP/s compare times): forward ``sum_steps
[2 * Hq * D * sum_d n_d^2 + 4 * Hq * D * T * i]`` (the causal step-0 part as
``bench.attention.causal_flops`` counts it, plus ``i`` diagonal keys per row at step ``i``),
backward 2.5x. Correctness, on the first ``check_cases`` cases: forward and all three gradients of
ours against the fp32 reference with FlashAttention's rule (error <= 2x the bf16 reference's,
plus a small floor), and bitwise equal across two runs. No speed target is set for this kernel
yet; the report gives the ratios. After ``budget_s`` seconds the baselines are skipped (and say
so); ours and the checks still run. ``--smoke`` runs tiny shapes on CPU through the Triton
interpreter (SDPA math backend); its numbers are not performance figures. Writes
``<out>/attention-ttt[-smoke].json`` (format ``dflash-attention-ttt-bench`` v1) and a markdown
table beside it, atomically.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_prep.bench.attention_dflash import _atomic_write

FORMAT = "dflash-attention-ttt-bench"
VERSION = 1
NAMES = ("o", "dq", "dk", "dv")
FLOOR = 1e-3  # bf16: allowed error floor relative to the reference's magnitude (as tests/kernels/helpers.py)
PROVIDERS = ("ours", "ours-per-step", "sdpa-mask", "reference")


@dataclass(frozen=True)
class TTTBenchConfig:
    """What to run; :func:`smoke_config` gives the CPU variant."""

    out: str = "results"
    """Folder for the JSON and the markdown table."""
    smoke: bool = False
    """Tiny CPU shapes through the interpreter; no timing claims."""
    tokens: tuple[int, ...] = (4096, 8192, 16384)
    """T of each case, in priority order (the baselines may run out of budget)."""
    doc_len: int = 2048
    """Longest document: T is cut into rounds of documents of doc_len, doc_len/2, doc_len/4, doc_len/4 tokens."""
    steps: int = 7
    """S: TTT steps."""
    heads_q: int = 32
    """Query heads."""
    heads_kv: int = 8
    """Key/value heads (GQA)."""
    head_dim: int = 128
    """D."""
    seed: int = 0
    """Seed of the random inputs."""
    budget_s: float = 120.0
    """After this many seconds, baselines (per-step, SDPA, reference) are skipped; ours and the checks still run."""
    check_cases: int = 1
    """Correctness checks on the first this many cases (the fp32 reference's memory grows with T)."""

    def __post_init__(self) -> None:
        from dflash_prep.errors import ConfigError

        if self.doc_len < 4 or self.doc_len % 4:
            raise ConfigError(f"doc_len must be a positive multiple of 4, got {self.doc_len}")
        for t in self.tokens:
            if t <= 0 or t % (2 * self.doc_len):
                raise ConfigError(f"tokens {t} must be a positive multiple of 2 * doc_len={2 * self.doc_len} "
                                  "(one round of documents)")
        if self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.heads_kv <= 0 or self.heads_q % self.heads_kv:
            raise ConfigError(f"heads_q={self.heads_q} must be a multiple of heads_kv={self.heads_kv}")
        if self.budget_s <= 0:
            raise ConfigError(f"budget_s must be > 0, got {self.budget_s}")


def smoke_config(out: str) -> TTTBenchConfig:
    return TTTBenchConfig(out=out, smoke=True, tokens=(64,), doc_len=16, steps=3, heads_q=2, heads_kv=1,
                          head_dim=32, budget_s=600)


def documents(tokens: int, doc_len: int) -> list[int]:
    """Document lengths of a case: rounds of (doc_len, doc_len/2, doc_len/4, doc_len/4), 2 * doc_len tokens each."""
    return [doc_len, doc_len // 2, doc_len // 4, doc_len // 4] * (tokens // (2 * doc_len))


def ttt_flops(doc_lens, steps: int, heads_q: int, head_dim: int) -> int:
    """Forward FLOPs of S steps: per step the causal part (``causal_flops``) plus i diagonal keys per row."""
    from dflash_prep.bench.attention import causal_flops

    total = int(sum(doc_lens))
    return steps * causal_flops(doc_lens, heads_q, head_dim) + sum(4 * heads_q * head_dim * total * i
                                                                    for i in range(steps))


# ----------------------------------------------------------------------------- inputs and providers
def make_case(cfg: TTTBenchConfig, tokens: int, device):
    """Leaves (q [S,T,Hq,D], k, v [S,T,Hkv,D]) bf16, cu_seqlens int32 on ``device``, and max_seqlen."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + tokens)
    docs = documents(tokens, cfg.doc_len)
    cu = torch.tensor([0] + docs, dtype=torch.int64).cumsum(0).to(torch.int32)

    def rnd(h):
        return torch.randn(cfg.steps, tokens, h, cfg.head_dim, generator=g).to(device, torch.bfloat16).requires_grad_()

    return [rnd(cfg.heads_q), rnd(cfg.heads_kv), rnd(cfg.heads_kv)], cu.to(device), max(docs)


def _ours(cu, max_seqlen, backend: str = "triton"):
    from dflash_prep.kernels.attention import ttt_attention

    def make(q, k, v):
        return lambda: ttt_attention(q, k, v, cu, max_seqlen, backend=backend)
    return make


def _ours_per_step(cu, max_seqlen):
    """S calls, the TTT loop's way: q of step i against the keys/values of steps 0..i."""
    import torch

    from dflash_prep.kernels.attention import ttt_attention

    def make(q, k, v):
        def fwd():
            return torch.stack([ttt_attention(q[i], k[:i + 1], v[:i + 1], cu, max_seqlen, backend="triton")
                                for i in range(q.shape[0])])
        return fwd
    return make


def _sdpa_mask(cu, steps: int, cuda: bool):
    """SDPA per document over the flattened (step, token) axes with the explicit TTT mask."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dflash_prep.kernels.ttt_reference import ttt_mask

    bounds = cu.tolist()
    spans = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    masks = {n: ttt_mask(torch.tensor([0, n], dtype=torch.int32, device=cu.device), steps, steps)
             for n in {b - a for a, b in spans}}  # (S*n, S*n) per document length, outside the timed region
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION] if cuda else [SDPBackend.MATH]

    def make(q, k, v):  # (S, T, Hq, D) each: GQA heads expanded beforehand
        def fwd():
            outs = []
            with sdpa_kernel(backends):
                for a, b in spans:
                    n = b - a
                    qd, kd, vd = (t[:, a:b].permute(2, 0, 1, 3).reshape(1, t.shape[2], steps * n, t.shape[3])
                                  for t in (q, k, v))  # (1, Hq, S*n, D)
                    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=masks[n])
                    outs.append(o[0].reshape(q.shape[2], steps, n, q.shape[3]).permute(1, 2, 0, 3))  # (S, n, Hq, D)
            return torch.cat(outs, dim=1)
        return fwd
    return make


# ----------------------------------------------------------------------------- checks
def _grads(fn, leaves, do):
    import torch

    xs = [t.detach().clone().requires_grad_() for t in leaves]
    o = fn(*xs)()
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def correctness(leaves, cu, max_seqlen, do) -> dict:
    """Ours vs the fp32 reference, with the bf16 reference's error as the yardstick; + determinism."""
    import torch

    from dflash_prep.kernels.ttt_reference import ttt_attention_reference

    ours = _grads(_ours(cu, max_seqlen), leaves, do)
    again = _grads(_ours(cu, max_seqlen), leaves, do)
    wide = [t.detach().float() for t in leaves]
    ref = _grads(lambda *xs: lambda: ttt_attention_reference(*xs, cu, max_seqlen), wide, do.float())
    same = _grads(lambda *xs: lambda: ttt_attention_reference(*xs, cu, max_seqlen, upcast=False), leaves, do)
    out = dict(deterministic=all(torch.equal(a, b) for a, b in zip(ours, again)), grads={})
    for name, g, r, s in zip(NAMES, ours, ref, same):
        err = float((g.float() - r).abs().max())
        err_same = float((s.float() - r).abs().max())
        bound = 2.0 * err_same + FLOOR * max(1.0, float(r.abs().max()))
        out["grads"][name] = dict(err=err, err_same_precision=err_same, bound=bound, passed=err <= bound)
    out["passed"] = out["deterministic"] and all(v["passed"] for v in out["grads"].values())
    del ours, again, ref, same
    return out


# ----------------------------------------------------------------------------- runner
class Runner:
    def __init__(self, cfg: TTTBenchConfig):
        import torch

        from dflash_prep.bench.attention import Timer

        self.cfg = cfg
        self.cuda = torch.cuda.is_available() and not cfg.smoke
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.timer = Timer(self.cuda)
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.checks: list[dict] = []

    def _time(self, base: dict, provider: str, fn_maker, inputs, *, ours: bool, ref=None):
        import torch

        from dflash_prep.bench.attention import timed_row

        spent = not ours and time.perf_counter() - self.t0 > self.cfg.budget_s
        skip = f"skipped: time budget {self.cfg.budget_s:.0f}s spent" if spent else None
        row, out = timed_row(self.timer, base, provider, fn_maker, inputs, ours=ours, skip=skip, ref=ref)
        self.rows.append(row)
        if self.cuda:
            torch.cuda.empty_cache()
        return out

    def case(self, index: int, tokens: int) -> None:
        import torch

        cfg = self.cfg
        leaves, cu, max_seqlen = make_case(cfg, tokens, self.device)
        docs = documents(tokens, cfg.doc_len)
        base = dict(T=tokens, steps=cfg.steps, docs=len(docs), max_seqlen=max_seqlen,
                    flops_fwd=ttt_flops(docs, cfg.steps, cfg.heads_q, cfg.head_dim))
        if index < cfg.check_cases:
            do = torch.randn(leaves[0].shape, generator=torch.Generator().manual_seed(cfg.seed)).to(self.device,
                                                                                                   torch.bfloat16)
            self.checks.append(dict(T=tokens, **correctness(leaves, cu, max_seqlen, do)))
        out = self._time(base, "ours", _ours(cu, max_seqlen), leaves, ours=True)
        self._time(base, "ours-per-step", _ours_per_step(cu, max_seqlen), leaves, ours=False, ref=out)
        group = cfg.heads_q // cfg.heads_kv
        expanded = [leaves[0]] + [t.detach().repeat_interleave(group, 2).requires_grad_() for t in leaves[1:]]
        self._time(base, "sdpa-mask", _sdpa_mask(cu, cfg.steps, self.cuda), expanded, ours=False, ref=out)
        del expanded
        self._time(base, "reference", _ours(cu, max_seqlen, backend="reference"), leaves, ours=False, ref=out)
        del leaves, out


def speedups(rows: list[dict], cfg: TTTBenchConfig) -> list[dict]:
    """Per case and baseline: baseline time / ours, forward and backward (None when either is missing)."""
    out = []
    for t in cfg.tokens:
        pick = {r["provider"]: r for r in rows if r["T"] == t}
        for other in PROVIDERS[1:]:
            entry = dict(T=t, baseline=other)
            for field in ("fwd_ms", "bwd_ms"):
                a, b = (pick.get(p, {}).get(field) for p in ("ours", other))
                entry[field[:3]] = None if a is None or b is None else b / a
            out.append(entry)
    return out


def markdown(report: dict) -> str:
    from dflash_prep.bench.attention import fmt

    lines = [f"# EAGLE-3 TTT attention check ({report['device']}, {report['created'][:10]})", ""]
    if report["smoke"]:
        lines += ["**Smoke run on CPU: times are not performance figures.**", ""]
    c = report["config"]
    lines += [f"Command: `{report['command']}`; torch {report['torch']}, triton {report['triton']}; bf16, "
              f"S={c['steps']}, Hq/Hkv={c['heads_q']}/{c['heads_kv']}, D={c['head_dim']}, documents up to "
              f"{c['doc_len']} tokens; TFLOP/s count useful FLOPs; max abs diff: output against ours.", "",
              "| T | provider | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | max abs diff | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['T']} | {r['provider']} | {fmt(r['fwd_ms'], '.3f')} | {fmt(r['bwd_ms'], '.3f')} | "
                     f"{fmt(r['fwd_tflops'])} | {fmt(r['bwd_tflops'])} | {fmt(r['max_abs_diff'], '.2e')} | "
                     f"{r['error'] or r['note'] or ''} |")
    lines += ["", "Speed-up of ours: baseline time / our time.", "", "| T | baseline | fwd | bwd |", "|---|---|---|---|"]
    for s in report["speedups"]:
        lines.append(f"| {s['T']} | {s['baseline']} | {fmt(s['fwd'], '.2f')} | {fmt(s['bwd'], '.2f')} |")
    lines += ["", "| T | correct (4 tensors, 2x rule) | deterministic | worst err / bound |", "|---|---|---|---|"]
    for ch in report["checks"]:
        worst = max(ch["grads"].values(), key=lambda g: g["err"] / g["bound"])
        lines.append(f"| {ch['T']} | {'yes' if ch['passed'] else '**no**'} | "
                     f"{'yes' if ch['deterministic'] else '**no**'} | {worst['err']:.2e} / {worst['bound']:.2e} |")
    return "\n".join(lines) + "\n"


def read_report(path: str | os.PathLike) -> dict:
    """Load a report, checking its format name and version."""
    from dflash_prep.errors import InputError

    report = json.loads(Path(path).read_text())
    if report.get("format") != FORMAT or report.get("version") != VERSION:
        raise InputError(f"{path}: not a {FORMAT} v{VERSION} file (format={report.get('format')!r}, "
                         f"version={report.get('version')!r}); rerun python -m dflash_prep.bench.attention_ttt")
    return report


def run(cfg: TTTBenchConfig) -> dict:
    """Run every case; write ``attention-ttt[-smoke].json`` + ``.md`` under ``cfg.out``; return the report."""
    import torch
    import triton

    runner = Runner(cfg)
    for i, t in enumerate(cfg.tokens):
        runner.case(i, t)
    report = dict(
        format=FORMAT, version=VERSION,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command="python3 -m dflash_prep.bench.attention_ttt" + (" --smoke" if cfg.smoke else ""),
        device=torch.cuda.get_device_name() if runner.cuda else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__, triton=triton.__version__, smoke=cfg.smoke,
        elapsed_s=round(time.perf_counter() - runner.t0, 1), config=asdict(cfg),
        rows=runner.rows, checks=runner.checks, speedups=speedups(runner.rows, cfg),
    )
    stem = "attention-ttt-smoke" if cfg.smoke else "attention-ttt"
    out = Path(cfg.out)
    _atomic_write(out / f"{stem}.json", (json.dumps(report, indent=1, sort_keys=True) + "\n").encode())
    _atomic_write(out / f"{stem}.md", markdown(report).encode())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dflash_prep.bench.attention_ttt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run through the Triton interpreter")
    parser.add_argument("--out", default="results", help="results folder (default: results/)")
    parser.add_argument("--budget-s", type=float, default=None, help="skip baselines after this many seconds")
    parser.add_argument("--tokens", default=None, help="cases T,T,... in priority order (default: 4096,8192,16384)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of the @triton.jit kernels
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench.attention_ttt: no CUDA GPU here; run with --smoke for the CPU check", file=sys.stderr)
        return 2
    cfg = smoke_config(args.out) if args.smoke else TTTBenchConfig(out=args.out)
    if args.budget_s is not None:
        cfg = TTTBenchConfig(**{**asdict(cfg), "budget_s": args.budget_s})
    if args.tokens:
        cfg = TTTBenchConfig(**{**asdict(cfg), "tokens": tuple(int(x) for x in args.tokens.split(","))})
    report = run(cfg)
    print(markdown(report))
    bad = [c for c in report["checks"] if not c["passed"]]
    if bad:
        print(f"{len(bad)} case(s) failed the correctness check; see the table above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

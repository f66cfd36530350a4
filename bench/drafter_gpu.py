"""DFlash drafter-training throughput on GPU: ours (packed, anchor-budgeted) vs the padded recipe (issue 16).

``PYTHONPATH=. python3 -m dflash_prep.bench.drafter_gpu --out DIR`` (part of ``make bench-gpu``; <= 4 min on
one H200) trains a 1-layer DFlash drafter (B = 16, at most 512 anchors per sample) on a frozen,
randomly initialised Qwen3-0.6B-shaped target (built in memory from a ``Qwen3Config``: 28 layers,
hidden 1024, 16 / 8 heads, head_dim 128, MLP 3072, vocab 151936; bf16, ``eval()``, no grad), with
the trainer's own code: :func:`dflash_prep.train.loop.train_step` with
:class:`~dflash_prep.train.objectives.dflash.objective.DFlashObjective` (bf16 autocast; the Triton varlen and
DFlash attention kernels on CUDA). Two data paths, in the same run, each with a fresh drafter
(same seed) and its own AdamW:

- *ours*: ``pack --objective dflash`` micro-batches (:func:`dflash_prep.pack.pack.build_epoch`, one
  rank, token budget ``T`` and the default anchor budget): documents packed back to back,
  anchors per document from the library sampler;
- *padded*: the public recipe's path (:func:`bench.drafter_data.recipe_epoch`): a random order,
  micro-batches of 2 rows padded to the longer, every row given ``min(512, most candidates in
  its micro-batch)`` blocks; the extra blocks (keyed random anchors) and the padding are
  computed with zero loss weight, as the recipe computes them.

Inputs: seedlike lengths with the synthetic prompt-then-response masks of
:func:`bench.drafter_data.seedlike_inputs` (divided by ``--scale`` in ``--smoke``), random ids.
Both paths run the same number of optimizer steps (one micro-batch each), round robin (one step
of each in turn) after ``--warmup`` untimed steps each. Batches are built on the CPU before the
timed loop; a timed step is ``train_step`` (host-to-device copy included) up to a CUDA sync.

Reported per path: anchors/s and target tokens/s (real ones only: padding and padded blocks do
not count), MFU (the objective's model FLOPs of the computed work, padding included, over the
GPU's dense bf16 peak; null on CPU), and the ratio ours / padded of anchors/s against the
1.3x target (on CUDA only: a CPU run's ``target_met`` is null and its table says "smoke", since
CPU figures say nothing about the GPU ratio). Output: ``--out/drafter_gpu.json`` (format ``dflash-prep/bench-drafter-gpu`` v1)
and ``--out/drafter_gpu.md``. ``--smoke`` runs the same code on CPU at tiny shapes (tests).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from dflash_prep.errors import ConfigError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json, fingerprint_array
from dflash_prep.formats.plan import Budget, Plan
from dflash_prep.objectives.anchors import anchor_counts
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.objectives.drafter_cost import DrafterCostModel
from dflash_prep.pack import pack
from dflash_prep.pack.batch_stats import class_edges
from dflash_prep.pack.config import PackConfig
from dflash_prep.synth import profiles

from dflash_prep.bench.drafter_data import recipe_epoch

BENCH_FORMAT = "dflash-prep/bench-drafter-gpu"
TARGET_RATIO = 1.3
B = 16
MAX_ANCHORS = 512


@dataclass(frozen=True)
class GpuBenchConfig:
    """One run; the defaults are the GPU configuration."""

    device: str = "cuda"
    layers: int = 28
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 3072
    vocab: int = 151936
    draft_layers: int = 1
    n: int = 4000
    """Seedlike samples drawn (both paths take their first steps from this epoch)."""
    scale: int = 1
    """Divide the seedlike lengths by this (at least 4 tokens)."""
    budget: int = 65536
    """Token budget T of ours."""
    steps: int = 20
    warmup: int = 3
    seed: int = 0
    sliding_window: int = 0
    """Sliding-window attention W of the drafter's layers (0 = full; the recipe's is 2048)."""

    def __post_init__(self):
        if min(self.n, self.scale, self.budget, self.steps, self.layers, self.draft_layers) < 1 or self.warmup < 0:
            raise ConfigError("bench.drafter_gpu: n, scale, budget, steps, layers and draft layers must be >= 1, "
                              "warmup >= 0")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bench.drafter_gpu: no CUDA GPU here; run with --smoke for the CPU check")


SMOKE = dict(device="cpu", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512,
             n=400, scale=32, budget=2048, steps=2, warmup=1)


# ----------------------------------------------------------------------------- inputs
class SyntheticMasks:
    """Random ids in ``[3, vocab - 1)`` (the last row is the mask token); loss mask 0 on a prompt
    prefix of ``L - S`` tokens, 1 on the supervised response of ``S`` (``bench.drafter_data``'s rule)."""

    def __init__(self, lens: np.ndarray, supervised: np.ndarray, vocab: int, seed: int):
        self.lens = np.asarray(lens, np.int64)
        self.off = np.concatenate([[0], np.cumsum(self.lens)])
        self.ids = np.random.default_rng([seed, 16]).integers(3, vocab - 1, int(self.off[-1])).astype(np.int32)
        self.mask = np.ones(int(self.off[-1]), np.uint8)
        for i, (L, s) in enumerate(zip(self.lens, supervised)):
            self.mask[self.off[i]:self.off[i] + L - int(s)] = 0

    def sample(self, i: int):
        s, e = int(self.off[i]), int(self.off[i + 1])
        return self.ids[s:e], self.mask[s:e]



def objective_config(device: str, **kw):
    """The trainer options a bench's DFlash objective runs with: the pre-recipe loss (decay
    weights, CE) and AdamW; its target is built in memory (the path only names it in logs)."""
    from dflash_prep.train.config import build as build_config

    return build_config(device=device, objective="dflash", target="(in-memory bench target)", slot_weights="decay",
                        optimizer="adamw", **kw)


def inputs(cfg: GpuBenchConfig):
    """Seedlike lengths (scaled) and their mask counts, as in :func:`bench.drafter_data.seedlike_inputs`."""
    lens = np.maximum(profiles.make_lengths("seedlike", n=cfg.n, seed=cfg.seed) // cfg.scale, 4).astype(np.int64)
    u = np.random.default_rng(cfg.seed).uniform(0.0, 0.8, len(lens))
    s = (lens - np.floor(u * lens).astype(np.int64)).astype(np.int32)
    return lens, lengths_mod.MaskCounts(supervised=s, anchor_candidates=np.maximum(s - 1, 0).astype(np.int32))


def ours_microbatches(cfg: GpuBenchConfig, lens, mc, cost: DrafterCostModel) -> list[np.ndarray]:
    """Sample ids of epoch 0's micro-batches from ``pack --objective dflash`` (one rank), step order."""
    l32 = lens.astype(np.int32)
    src = lengths_mod.LengthSource(l32, "lengths", f"seedlike {cfg.n}", fingerprint_array(l32))
    plan = Plan(data=src.describe(), boundaries=(), budget=Budget(value=cfg.budget), seed=cfg.seed).with_fingerprint()
    pc = PackConfig(world_size=1, objective="dflash",
                    options=DrafterOptions(cost_model=cost, block_size=B, max_anchors=MAX_ANCHORS))
    res = pack.build_epoch(l32, plan, pc, 0, class_edges(l32), mask_counts=mc)
    t, sids = res.arrays["microbatches"], res.arrays["sample_ids"]
    return [np.asarray(sids[r[0]:r[0] + r[1]], np.int64) for r in t[np.argsort(t[:, 2], kind="stable")]]


def padded_batch(obj, ds, sids: np.ndarray, k: np.ndarray, step: int, rng: np.random.Generator):
    """One recipe micro-batch: the real blocks (:meth:`DFlashObjective.build`) of its rows, each row
    padded to the longest and topped up to ``min(512, max k)`` blocks with zero-weight ones.
    ``(batch, real tokens, real anchors)``; the batch's token/anchor counts are the computed ones."""
    from dflash_prep.train.objectives.dflash.batch import DFlashBatch

    b = obj.build(ds, SimpleNamespace(sample_ids=sids, step=step, rank=0, accum=0), 0, "varlen", False)
    lens = np.diff(b.cu_seqlens.numpy()).astype(np.int64)
    Lmax, D = int(lens.max()), len(sids)
    kpad = int(min(MAX_ANCHORS, k[sids].max()))
    mask_id, pad_id = obj.model.config.mask_token_id, 0
    ids = torch.full((D, Lmax), pad_id, dtype=torch.int64)
    for j in range(D):
        ids[j, :lens[j]] = b.input_ids[int(b.cu_seqlens[j]):int(b.cu_seqlens[j + 1])]
    cb = b.cu_blk.numpy() // B
    anc, noise, bpos, tgt, w = [], [], [], [], []
    for j in range(D):
        a = b.anchors[cb[j]:cb[j + 1]].numpy().astype(np.int64)
        sl = slice(int(cb[j]) * B, int(cb[j + 1]) * B)
        extra = np.sort(rng.integers(0, Lmax, max(0, kpad - len(a))))
        aa = np.concatenate([a, extra])
        o = np.argsort(aa, kind="stable")
        pad_noise = np.full((len(extra), B), mask_id, np.int64)
        pad_noise[:, 0] = ids[j, extra].numpy()
        r = np.arange(B, dtype=np.int64)
        anc.append(aa[o])
        noise.append(np.concatenate([b.noise_ids[sl].numpy().reshape(-1, B), pad_noise])[o].reshape(-1))
        bpos.append((aa[o][:, None] + r[None, :]).reshape(-1))
        tgt.append(np.concatenate([b.targets[sl].numpy().reshape(-1, B), np.zeros((len(extra), B), np.int64)])[o]
                   .reshape(-1))
        w.append(np.concatenate([b.weights[sl].numpy().reshape(-1, B), np.zeros((len(extra), B), np.float32)])[o]
                 .reshape(-1))
    nblk = [len(a) for a in anc]
    T = D * Lmax
    t = lambda x, dt=torch.int64: torch.from_numpy(np.ascontiguousarray(np.concatenate(x))).to(dt)  # noqa: E731
    pb = DFlashBatch(step=step, accum=0, sample_ids=sids, input_ids=ids.reshape(-1),
                     position_ids=torch.arange(Lmax, dtype=torch.int64).repeat(D),
                     cu_seqlens=torch.arange(0, T + 1, Lmax, dtype=torch.int32), max_seqlen=Lmax,
                     anchors=t(anc, torch.int32), cu_blk=torch.tensor(np.concatenate([[0], np.cumsum(nblk)]) * B,
                                                                      dtype=torch.int32),
                     noise_ids=t(noise), blk_pos=t(bpos), targets=t(tgt), weights=t(w, torch.float32),
                     weight_sum=b.weight_sum, real_tokens=T, padded_tokens=T, n_anchors=int(sum(nblk)))
    return pb, int(b.real_tokens), int(b.n_anchors)


# ----------------------------------------------------------------------------- models
def build_target(cfg: GpuBenchConfig, dev: torch.device, taps):
    """A random Qwen3 causal LM in memory, frozen, wrapped as a :class:`FrozenTarget`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_prep.train.target import ATTN_IMPL, FrozenTarget, register_attention

    register_attention()
    hc = Qwen3Config(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                     num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=40960, tie_word_embeddings=True,
                     attn_implementation=ATTN_IMPL)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)
    with torch.device(dev):
        model = Qwen3ForCausalLM(hc).to(dtype).eval()
    t = FrozenTarget.from_model(model, taps, device=dev)
    return t, hc


class _Path:
    """One data path: its drafter, optimizer, prebuilt steps and timings."""

    def __init__(self, name, obj, opt, steps, cfg: GpuBenchConfig, dev):
        self.name, self.obj, self.opt, self.batches, self.dev = name, obj, opt, steps, dev
        self.warm, self.todo = cfg.warmup, cfg.steps
        from dflash_prep.train import distributed
        from dflash_prep.train.loop import _autocast_for

        self.d = distributed.Dist(0, 1, 0, dev)
        self.autocast = _autocast_for(dev, True)
        self.i = 0
        self.wall = self.flops = 0.0
        self.tokens = self.anchors = self.computed_tokens = self.computed_anchors = 0
        self.tau = []

    def _run(self, sb):
        from dflash_prep.train.loop import train_step

        st = train_step(self.obj.model, self.opt, sb, lr=1e-4, grad_clip=1.0, d=self.d, autocast=self.autocast,
                        objective=self.obj)
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return st

    def step(self) -> bool:
        if self.i >= self.warm + self.todo:
            return False
        sb, real, anchors = self.batches[self.i]
        t0 = time.perf_counter()
        st = self._run(sb)
        dt = time.perf_counter() - t0
        if self.i >= self.warm:
            self.wall += dt
            self.flops += st["flops"]
            self.tokens += real
            self.anchors += anchors
            self.computed_tokens += st["real_tokens"]
            self.computed_anchors += sum(b.n_anchors for b in sb.micro)
            self.tau.append(st["tau"])
        self.i += 1
        return True

    def result(self, peak) -> dict:
        return {"path": self.name, "timed_steps": self.i - self.warm, "time_s": self.wall,
                "anchors": self.anchors, "target_tokens": self.tokens, "computed_anchors": self.computed_anchors,
                "computed_tokens": self.computed_tokens, "anchors_per_s": self.anchors / self.wall,
                "tokens_per_s": self.tokens / self.wall, "model_flops": self.flops,
                "mfu": self.flops / self.wall / peak if peak else None,
                "useful_anchor_slots": self.anchors / max(1, self.computed_anchors),
                "useful_tokens": self.tokens / max(1, self.computed_tokens)}


def run(cfg: GpuBenchConfig) -> dict:
    """Both paths, round robin; returns the report (what ``drafter_gpu.json`` holds)."""
    from dflash_prep.train.data import StepBatches
    from dflash_prep.train.distributed import peak_flops
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
    from dflash_prep.train.optim import build_optimizer
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec, default_gamma

    dev = torch.device(cfg.device)
    torch.use_deterministic_algorithms(False)
    lens, mc = inputs(cfg)
    k = anchor_counts(mc.anchor_candidates, mc.supervised, MAX_ANCHORS)
    cost = DrafterCostModel(hidden=cfg.hidden, layers=cfg.layers, intermediate=cfg.intermediate, heads=cfg.heads,
                            kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, vocab=cfg.vocab, draft_layers=cfg.draft_layers,
                            sliding_window=cfg.sliding_window)
    need = cfg.warmup + cfg.steps
    ours_mbs = ours_microbatches(cfg, lens, mc, cost)
    order, off = recipe_epoch(lens, k, 0, cfg.seed)
    pairs = [order[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    if min(len(ours_mbs), len(pairs)) < need:
        raise ConfigError(f"bench.drafter_gpu: {min(len(ours_mbs), len(pairs))} steps for {need} (warmup + steps); "
                          "raise --n")
    ds = SyntheticMasks(lens, mc.supervised, cfg.vocab, cfg.seed)
    taps = build_target_layer_ids(cfg.layers, cfg.draft_layers)
    target, hc = build_target(cfg, dev, taps)        # one frozen target, shared by both paths
    paths = []
    rng = np.random.default_rng([cfg.seed, 2])
    tc = objective_config(cfg.device)
    for name in ("ours: pack --objective dflash", "padded: random pairs (recipe)"):
        torch.manual_seed(cfg.seed)                  # the same drafter init for both
        dcfg = DrafterConfig.from_target_config(hc, cfg.draft_layers, B, cfg.vocab - 1, target_layer_ids=taps,
                                                sliding_window=cfg.sliding_window)
        drafter = Drafter(dcfg).to(dev)
        spec = AnchorSpec(seed=cfg.seed, max_anchors=MAX_ANCHORS, policy="cap", block_size=B)
        obj = DFlashObjective(drafter, target, tc, anchor_spec=spec, gamma=default_gamma(B), identity={})
        steps = []
        for s in range(need):
            if name.startswith("ours"):
                mb = SimpleNamespace(sample_ids=ours_mbs[s], step=s, rank=0, accum=0)
                b = obj.build(ds, mb, 0, "varlen", dev.type == "cuda")
                steps.append((StepBatches(0, s, [b]), b.real_tokens, b.n_anchors))
            else:
                b, real, na = padded_batch(obj, ds, pairs[s], k, s, rng)
                steps.append((StepBatches(0, s, [b]), real, na))
        paths.append(_Path(name, obj, build_optimizer(drafter, tc), steps, cfg, dev))
    busy = list(paths)
    while busy:  # round robin: drifting load hits both paths alike
        busy = [p for p in busy if p.step()]
    peak = peak_flops(dev)
    rows = [p.result(peak) for p in paths]
    ratio = rows[0]["anchors_per_s"] / rows[1]["anchors_per_s"]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        f"{platform.processor() or platform.machine()} CPU"
    return {"config": asdict(cfg), "block_size": B, "max_anchors": MAX_ANCHORS, "target_layer_ids": taps,
            "rows": rows, "ratio_anchors_per_s": ratio, "target_ratio": TARGET_RATIO,
            "smoke": dev.type != "cuda", "target_met": ratio >= TARGET_RATIO if dev.type == "cuda" else None,
            "peak_flops": peak, "machine": f"{name}, torch {torch.__version__}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def table(rep: dict) -> str:
    out = ["| path | anchors/s | target tokens/s | MFU | useful anchor slots | useful tokens | timed steps |",
           "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        out.append(f"| {r['path']} | {r['anchors_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                   f"{r['useful_anchor_slots']:.3f} | {r['useful_tokens']:.3f} | {r['timed_steps']} |")
    met = "smoke: CPU figures, no verdict" if rep["target_met"] is None else ("met" if rep["target_met"] else "NOT met")
    out.append(f"\nours / padded anchors/s: **{rep['ratio_anchors_per_s']:.2f}x** (target >= {TARGET_RATIO}x: {met}); "
               f"{rep['date']} on {rep['machine']}")
    return "\n".join(out)


def write_report(out: Path, stem: str, rep: dict, md: str, *, format: str) -> None:
    """Write ``out/<stem>.json`` (``format`` v1) and ``out/<stem>.md`` (``md``), then print ``md``:
    how :mod:`bench.drafter_cpu` and :mod:`bench.drafter_variants_gpu` end their ``main``."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", rep, format=format, version=1)
    atomic_write_bytes(out / f"{stem}.md", (md + "\n").encode())
    print(md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.drafter_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the same code on CPU at tiny shapes (tests)")
    ap.add_argument("--out", type=Path, required=True, help="folder for drafter_gpu.json and drafter_gpu.md")
    for f in ("n", "scale", "budget", "steps", "warmup", "seed", "sliding_window"):
        ap.add_argument(f"--{f}", type=int, default=None)
    a = ap.parse_args(argv)
    cfg = GpuBenchConfig(**SMOKE) if a.smoke else GpuBenchConfig()
    cfg = replace(cfg, **{f: v for f in ("n", "scale", "budget", "steps", "warmup", "seed", "sliding_window")
                          if (v := getattr(a, f)) is not None})
    print(f"bench.drafter_gpu: {cfg}", flush=True)
    rep = run(cfg)
    md = table(rep)
    print(md)
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "drafter_gpu.json", rep, format=BENCH_FORMAT, version=1)
    atomic_write_bytes(a.out / "drafter_gpu.md", (md + "\n").encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Small in-memory stand-ins that honour the dataset / manifest / source contracts.

They let the trainer's tests control every micro-batch exactly (step, rank, accumulation
slot) and run in a second. Everything is a pure function of its arguments, so a spawned
worker process rebuilds the same data from the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.formats.plan import Budget
from dflash_prep.pack.bucketing import pack_padded_epoch

VOCAB = 97


class FakeDataset:
    """``n`` samples with lengths in ``[lo, hi]``; ids and loss mask drawn from ``seed``.

    The loss mask is 0 on a random prompt prefix and 1 after it, like a chat sample.
    """

    def __init__(self, n: int = 48, lo: int = 4, hi: int = 40, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(lo, hi + 1, n).astype(np.int32)
        self._ids = [rng.integers(3, VOCAB, L).astype(np.int32) for L in self.lengths]
        self._mask = []
        for L in self.lengths:
            m = np.ones(L, np.uint8)
            m[: rng.integers(1, max(2, L // 2))] = 0
            self._mask.append(m)
        self.fingerprint = f"fake-data-{n}-{lo}-{hi}-{seed}"
        self.tokenizer_info = {"vocab_size": VOCAB, "pad_id": 0, "eos_id": 1, "bos_id": 2}
        self.reads: list[int] = []

    def __len__(self):
        return len(self.lengths)

    def sample(self, i: int):
        self.reads.append(int(i))
        return self._ids[i], self._mask[i]


@dataclass
class FakeMB:
    step: int
    rank: int
    accum: int
    bucket: int
    sample_ids: np.ndarray
    max_len: int
    real_tokens: int
    padded_tokens: int


class FakeManifest:
    """Micro-batches given as a list of sample-id arrays, laid out step-major.

    Micro-batch ``m`` goes to step ``m // (W * A)``, rank ``(m % (W * A)) // A``,
    accumulation slot ``m % A``: the same global micro-batches for any (W, A) with equal
    ``W * A``, which is what the loss-normalisation test needs.
    """

    def __init__(self, ds: FakeDataset, batches: list[np.ndarray], *, world_size: int = 1, grad_accum: int = 1,
                 layout: str = "padded", epoch: int = 0, plan_fingerprint: str = "plan-a",
                 eagle3: tuple[int, int] | None = None):
        self.epoch, self.layout, self.world_size, self.grad_accum = epoch, layout, world_size, grad_accum
        self.path, self.header, self.arrays = f"fake-manifest/epoch-{epoch:04d}", {}, {}
        if eagle3 is not None:      # (draft vocabulary, TTT steps): what pack --objective eagle3 adds
            self._eagle3(ds, *eagle3)
        self.plan_fingerprint, self.data_fingerprint = plan_fingerprint, ds.fingerprint
        per = world_size * grad_accum
        self.num_steps = -(-len(batches) // per)
        self._mbs = []
        for m, ids in enumerate(batches):
            lens = ds.lengths[ids].astype(np.int64)
            self._mbs.append(FakeMB(m // per, (m % per) // grad_accum, m % grad_accum, 0, np.asarray(ids, np.int64),
                                    int(lens.max()), int(lens.sum()), int(len(ids) * lens.max())))

    def _eagle3(self, ds: FakeDataset, draft_vocab: int, ttt_steps: int) -> None:
        """The ``eagle3`` header section and ``d2t``/``t2d`` arrays of the real map of the fake data."""
        from dflash_prep.objectives.eagle3 import vocab_map

        counts = np.zeros(VOCAB, np.int64)
        for ids, m in zip(ds._ids, ds._mask):
            np.add.at(counts, ids[1:][m[1:] > 0], 1)
        vm = vocab_map.build(counts, draft_vocab)
        self.arrays = {"d2t": vm.d2t, "t2d": vm.t2d}
        self.header = {"options": {"objective": "eagle3"}, "eagle3": {
            "draft_vocab_size": vm.draft_vocab_size, "vocab_size": vm.vocab_size, "ttt_steps": int(ttt_steps),
            "trained_ids": vm.trained_ids, "vocab_coverage": vm.coverage, "map_fingerprint": vm.fingerprint}}

    def microbatches(self, rank: int, start_step: int = 0):
        for mb in self._mbs:
            if mb.rank == rank and mb.step >= start_step:
                yield mb


def packed_batches(ds: FakeDataset, *, epoch: int, seed: int = 0, budget: int = 96, boundaries=(12, 24)):
    """The real greedy bucketed packer over the fake lengths, keyed by (seed, epoch)."""
    order, offsets, _ = pack_padded_epoch(ds.lengths, list(boundaries), seed=seed, epoch=epoch,
                                          budget=Budget(value=budget))
    bs = [order[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    perm = np.random.default_rng([seed, epoch]).permutation(len(bs))  # batch order shuffled per epoch
    return [bs[i] for i in perm]


class FakeSource:
    """The trainer's data-source contract over fakes; ``plan`` names the plan identity."""

    def __init__(self, *, n: int = 48, world_size: int = 1, grad_accum: int = 1, layout: str = "padded",
                 plan: str = "plan-a", seed: int = 0, budget: int = 96, boundaries=(12, 24),
                 eagle3: tuple[int, int] | None = None):
        self.dataset = FakeDataset(n=n)
        self.eagle3 = eagle3
        self.world_size, self.grad_accum, self.layout = world_size, grad_accum, layout
        self.plan_fingerprint = plan
        self.seed, self.budget, self.boundaries = seed, budget, tuple(boundaries)
        self.opened: list[int] = []

    def run_identity(self) -> dict:
        return {"plan": {"boundaries": list(self.boundaries), "budget": self.budget, "seed": self.seed},
                "plan_fingerprint": self.plan_fingerprint, "data_fingerprint": self.dataset.fingerprint}

    def manifest(self, epoch: int) -> FakeManifest:
        self.opened.append(epoch)
        bs = packed_batches(self.dataset, epoch=epoch, seed=self.seed, budget=self.budget, boundaries=self.boundaries)
        return FakeManifest(self.dataset, bs, world_size=self.world_size, grad_accum=self.grad_accum,
                            layout=self.layout, epoch=epoch, plan_fingerprint=self.plan_fingerprint,
                            eagle3=self.eagle3)


# ----------------------------------------------------------------------------- spawned workers
def gloo_worker(rank: int, world: int, init_file: str, out_dir: str, kind: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``: join a gloo group, then do ``kind``.

    ``grads``: one optimizer step of :class:`FakeSource` (W=world, A=1) with no clipping;
    rank 0 saves the summed gradients. ``train``: a short :func:`dflash_prep.train.loop.train` run; every
    rank saves its summary and a parameter checksum. ``both``: one then the other, in one
    spawn (starting processes is most of the cost on a small machine).
    """
    import contextlib
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.distributed import Dist
    from dflash_prep.train.loop import train, train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    d = Dist(rank, world, 0, torch.device("cpu"))
    out = Path(out_dir)
    try:
        if kind not in ("grads", "train", "both"):
            raise ValueError(kind)
        if kind in ("grads", "both"):
            model, opt, sb = grads_setup(world, 1, rank)
            train_step(model, opt, sb, lr=1e-3, grad_clip=0.0, d=d, autocast=contextlib.nullcontext)
            if rank == 0:
                torch.save({n: p.grad.clone() for n, p in model.named_parameters()}, out / "grads.pt")
        if kind in ("train", "both"):
            cfg = build_config(out=str(out / "run"), model="tiny", model_overrides=SMALL_MODEL, progress=False,
                              max_steps=4, warmup_steps=1, lr=1e-2, device="cpu", prefetch=2)
            summary = train(cfg, source=FakeSource(n=48, world_size=world), dist_ctx=d)
            model_sum = sum(float(v.double().sum()) for v in
                            torch.load(out / "run" / "checkpoint.pt", weights_only=True)["model"].values()) \
                if rank == 0 else None
            torch.save({"summary": summary, "model_sum": model_sum}, out / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


SMALL_MODEL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def grads_setup(world: int, accum: int, rank: int):
    """Model, optimizer and step-0 batches of rank ``rank`` for W x A over the same micro-batches."""
    import torch

    from dflash_prep.train.config import ModelConfig, build as build_config
    from dflash_prep.train.data import iter_steps
    from dflash_prep.train.optim import build_optimizer
    from dflash_prep.train.objectives.lm.model import Decoder

    torch.manual_seed(0)
    model = Decoder(ModelConfig(vocab_size=VOCAB, n_layers=2, **SMALL_MODEL))
    opt = build_optimizer(model, build_config(device="cpu"))
    src = FakeSource(n=48, world_size=world, grad_accum=accum)
    sb = next(iter(iter_steps(src.dataset, src.manifest(0), rank)))
    return model, opt, sb

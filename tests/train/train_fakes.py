"""Small in-memory stand-ins that honour the dataset / manifest / source contracts.

They let the trainer's tests control every micro-batch exactly (step, rank, accumulation
slot) and run in a second. Everything is a pure function of its arguments, so a spawned
worker process rebuilds the same data from the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.packing import pack_padded_epoch

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
                 layout: str = "padded", epoch: int = 0, plan_fingerprint: str = "plan-a"):
        self.epoch, self.layout, self.world_size, self.grad_accum = epoch, layout, world_size, grad_accum
        self.plan_fingerprint, self.data_fingerprint = plan_fingerprint, ds.fingerprint
        per = world_size * grad_accum
        self.num_steps = -(-len(batches) // per)
        self._mbs = []
        for m, ids in enumerate(batches):
            lens = ds.lengths[ids].astype(np.int64)
            self._mbs.append(FakeMB(m // per, (m % per) // grad_accum, m % grad_accum, 0, np.asarray(ids, np.int64),
                                    int(lens.max()), int(lens.sum()), int(len(ids) * lens.max())))

    def microbatches(self, rank: int, start_step: int = 0):
        for mb in self._mbs:
            if mb.rank == rank and mb.step >= start_step:
                yield mb


def packed_batches(ds: FakeDataset, *, epoch: int, seed: int = 0, budget: int = 96, boundaries=(12, 24)):
    """The real greedy bucketed packer over the fake lengths, keyed by (seed, epoch)."""
    order, offsets, _ = pack_padded_epoch(ds.lengths, list(boundaries), seed=seed, epoch=epoch, budget=budget)
    bs = [order[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    perm = np.random.default_rng([seed, epoch]).permutation(len(bs))  # batch order shuffled per epoch
    return [bs[i] for i in perm]


class FakeSource:
    """The trainer's data-source contract over fakes; ``plan`` names the plan identity."""

    def __init__(self, *, n: int = 48, world_size: int = 1, grad_accum: int = 1, layout: str = "padded",
                 plan: str = "plan-a", seed: int = 0, budget: int = 96, boundaries=(12, 24)):
        self.dataset = FakeDataset(n=n)
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
                            layout=self.layout, epoch=epoch, plan_fingerprint=self.plan_fingerprint)

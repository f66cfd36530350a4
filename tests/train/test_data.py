"""Loader: label shift and mask per sample, no leak across documents, FIFO prefetch, order."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dflash_prep.errors import FormatError
from dflash_prep.train.config import ModelConfig
from dflash_prep.train.data import IGNORE, Prefetcher, build_batch, iter_steps, shifted_labels
from dflash_prep.train.objectives.lm.model import Decoder, token_loss_sum

from dflash_prep.tests.train.train_fakes import FakeDataset, FakeManifest, packed_batches

TINY = ModelConfig(vocab_size=97, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def _mb(ds, ids, step=0):
    lens = ds.lengths[ids].astype(np.int64)
    return type("MB", (), dict(step=step, rank=0, accum=0, sample_ids=np.asarray(ids, np.int64),
                               max_len=int(lens.max())))()


def test_shifted_labels_semantics():
    ids = np.array([5, 6, 7, 8, 9], np.int32)
    mask = np.array([0, 0, 1, 1, 0], np.uint8)
    # position t predicts ids[t+1], counted where mask[t+1]; the last position has no target
    assert shifted_labels(ids, mask).tolist() == [IGNORE, 7, 8, IGNORE, IGNORE]
    assert shifted_labels(ids[:1], mask[:1]).tolist() == [IGNORE]


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_labels_align_per_sample_and_never_cross_documents(layout):
    ds = FakeDataset(n=6, lo=3, hi=9, seed=1)
    sel = [4, 0, 2]
    b = build_batch(ds, _mb(ds, sel), layout, pad_id=0)
    want_targets = 0
    for r, sid in enumerate(sel):
        ids, mask = ds.sample(sid)
        L = len(ids)
        if layout == "padded":
            row_ids, row_lab = b.input_ids[r].numpy(), b.labels[r].numpy()
            assert (row_ids[:L] == ids).all() and (row_ids[L:] == 0).all()
            assert (row_lab[L:] == IGNORE).all()  # padding is never a target
        else:
            s, e = int(b.cu_seqlens[r]), int(b.cu_seqlens[r + 1])
            assert e - s == L
            row_ids, row_lab = b.input_ids[s:e].numpy(), b.labels[s:e].numpy()
            assert (row_ids == ids).all()
            assert b.position_ids[s:e].tolist() == list(range(L))
        for t in range(L - 1):
            assert row_lab[t] == (ids[t + 1] if mask[t + 1] else IGNORE)
        assert row_lab[L - 1] == IGNORE  # the next document's first token is never a label
        want_targets += int(mask[1:].sum())
    assert b.n_targets == want_targets
    assert b.real_tokens == int(ds.lengths[sel].sum())
    if layout == "padded":
        assert b.lengths.dtype == torch.int32 and b.lengths.tolist() == ds.lengths[sel].tolist()
        assert b.padded_tokens == 3 * int(ds.lengths[sel].max())
    else:
        assert b.cu_seqlens.dtype == torch.int32 and b.padded_tokens == b.real_tokens


def test_padded_varlen_and_per_sample_losses_agree():
    """Same samples: the padded, varlen and one-at-a-time losses match (no cross-doc attention)."""
    torch.manual_seed(0)
    model = Decoder(TINY)
    ds = FakeDataset(n=5, lo=3, hi=12, seed=2)
    sel = [0, 1, 2, 3, 4]
    with torch.no_grad():
        pb = build_batch(ds, _mb(ds, sel), "padded")
        vb = build_batch(ds, _mb(ds, sel), "varlen")
        lp = token_loss_sum(model(pb.input_ids, **pb.model_inputs()), pb.labels)
        lv = token_loss_sum(model(vb.input_ids, **vb.model_inputs()), vb.labels)
        one = sum(token_loss_sum(model(b.input_ids, **b.model_inputs()), b.labels)
                  for b in (build_batch(ds, _mb(ds, [s]), "padded") for s in sel))
    torch.testing.assert_close(lp, lv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, one, rtol=1e-5, atol=1e-5)


def test_iter_steps_follows_manifest_order_and_yields_empty_steps():
    ds = FakeDataset(n=40)
    bs = packed_batches(ds, epoch=0)
    m = FakeManifest(ds, bs, world_size=3, grad_accum=2)
    for rank in range(3):
        got = [(sb.step, [b.sample_ids.tolist() for b in sb.micro]) for sb in iter_steps(ds, m, rank)]
        assert [s for s, _ in got] == list(range(m.num_steps))  # every step, even an empty one
        want = [mb.sample_ids.tolist() for mb in m.microbatches(rank)]
        assert [ids for _, mbs in got for ids in mbs] == want
    start = m.num_steps - 1
    tail = list(iter_steps(ds, m, 0, start_step=start))
    assert [sb.step for sb in tail] == [start]


def test_out_of_order_manifest_is_an_error():
    ds = FakeDataset(n=20)
    m = FakeManifest(ds, packed_batches(ds, epoch=0))
    m._mbs = m._mbs[::-1]
    with pytest.raises(FormatError, match="not in step order"):
        list(iter_steps(ds, m, 0))


def test_prefetch_is_fifo_even_when_later_items_are_ready_first():
    """Items take uneven time to build; the consumer still sees exactly the input order."""
    delays = [0.03, 0.0, 0.0, 0.02, 0.0, 0.01, 0.0, 0.0]

    def produce():
        for i, dl in enumerate(delays):
            time.sleep(dl)
            yield i

    with Prefetcher(produce(), depth=3) as pf:
        got = list(pf)
    assert got == list(range(len(delays)))
    assert pf.wait_s > 0.0


def test_prefetch_consumed_batches_equal_manifest_order():
    ds = FakeDataset(n=60)
    m = FakeManifest(ds, packed_batches(ds, epoch=1), world_size=1, grad_accum=2)
    with Prefetcher(iter_steps(ds, m, 0), depth=2) as pf:
        consumed = [b.sample_ids.tolist() for sb in pf for b in sb.micro]
    assert consumed == [mb.sample_ids.tolist() for mb in m.microbatches(0)]


def test_prefetch_reraises_producer_errors_in_place():
    def produce():
        yield 1
        raise FormatError("shard 3 is corrupt")

    with Prefetcher(produce(), depth=2) as pf:
        assert next(pf) == 1
        with pytest.raises(FormatError, match="shard 3"):
            next(pf)


def test_prefetch_close_stops_a_blocked_producer():
    started = threading.Event()

    def produce():
        started.set()
        yield from range(10_000)

    pf = Prefetcher(produce(), depth=1)
    started.wait(2)
    pf.close()
    assert not pf._thread.is_alive()


def test_sample_longer_than_manifest_max_len_is_refused():
    ds = FakeDataset(n=4, lo=5, hi=9)
    mb = _mb(ds, [0, 1])
    mb.max_len = 2
    with pytest.raises(FormatError, match="max_len"):
        build_batch(ds, mb, "padded")

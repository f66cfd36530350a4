"""anchors.py: the DFlash anchor sampler (eligibility, order, determinism, batching, counts)."""

import numpy as np
import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import anchor_digest, anchors
from dflash_prep.pack.keyed import mix_key


def _masks(n, seed=0, top=300):
    """n random masks: a prompt prefix of random share, a supervised response, random holes."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(1, top))
        m = np.zeros(L, np.uint8)
        m[int(rng.integers(0, L + 1)):] = 1
        m[rng.random(L) < 0.05] = 0
        out.append(m)
    return out


def _eligible(m):
    m = np.asarray(m, bool)
    return np.flatnonzero(m[:-1] & m[1:])


def test_counts_match_definition():
    for m in _masks(200, seed=1):
        s, c = anchors.mask_counts(m)
        assert s == int(m.sum()) and c == len(_eligible(m))
    masks = _masks(50, seed=2)
    cu = np.concatenate([[0], np.cumsum([len(m) for m in masks])])
    sup, cand = anchors.mask_counts(np.concatenate(masks), cu)
    assert sup.dtype == np.int32 and cand.tolist() == [len(_eligible(m)) for m in masks]
    k = anchors.anchor_counts(cand, sup, 40, "cap")
    assert k.dtype == np.int32 and np.array_equal(k, np.minimum(cand, 40))
    kd = anchors.anchor_counts(cand, sup, 40, "density", block_size=16)
    assert np.array_equal(kd, np.minimum(np.minimum(cand, 40), -(-sup.astype(np.int64) // 16)))


@pytest.mark.parametrize("policy", ["cap", "density"])
def test_anchors_are_sorted_distinct_eligible_and_counted(policy):
    for i, m in enumerate(_masks(300, seed=3)):
        a = anchors.sample_anchors(m, seed=7, epoch=1, sample_id=i, max_anchors=25, policy=policy, block_size=8)
        s, c = anchors.mask_counts(m)
        assert a.dtype == np.int32
        assert np.all(np.diff(a) > 0)
        assert np.isin(a, _eligible(m)).all()
        assert len(a) == anchors.anchor_counts([c], [s], 25, policy, block_size=8)[0]


def test_deterministic_keyed_and_uniform():
    m = np.ones(101, np.uint8)                       # 100 candidates, 10 anchors
    a = anchors.sample_anchors(m, seed=1, epoch=0, sample_id=5, max_anchors=10)
    assert np.array_equal(a, anchors.sample_anchors(m, seed=1, epoch=0, sample_id=5, max_anchors=10))
    others = [anchors.sample_anchors(m, seed=s, epoch=e, sample_id=i, max_anchors=10)
              for s, e, i in ((2, 0, 5), (1, 1, 5), (1, 0, 6))]
    assert all(not np.array_equal(a, o) for o in others)
    # a uniform 10-of-100 draw: every position is picked ~1/10 of the time over many keys
    hits = np.zeros(100)
    for i in range(2000):
        hits[anchors.sample_anchors(m, seed=0, epoch=0, sample_id=i, max_anchors=10)] += 1
    assert np.abs(hits / 2000 - 0.1).max() < 0.03, hits.min()
    # all candidates when the cap is not binding (no draw)
    assert np.array_equal(anchors.sample_anchors(m, seed=9, epoch=3, sample_id=1, max_anchors=512), np.arange(100))


def test_independent_of_batching():
    masks = _masks(120, seed=4)
    ids = np.arange(1000, 1120, dtype=np.int64)
    alone = [anchors.sample_anchors(m, seed=3, epoch=2, sample_id=int(i), max_anchors=17) for m, i in zip(masks, ids)]
    for lo, hi in ((0, 120), (10, 37), (50, 51)):
        cu = np.concatenate([[0], np.cumsum([len(m) for m in masks[lo:hi]])])
        pos, off = anchors.sample_anchors_batch(np.concatenate(masks[lo:hi]), cu, ids[lo:hi], seed=3, epoch=2,
                                                max_anchors=17)
        for j in range(hi - lo):
            assert np.array_equal(pos[off[j]:off[j + 1]], alone[lo + j])


def test_fold_matches_mix_key():
    base = anchors._base_key(11, 4)
    assert int(anchors._fold(base, np.uint64(123456789))) == mix_key(11, 4, anchors.PURPOSE_ANCHORS, 123456789)


def test_selection_digest_tracks_the_draw():
    masks = _masks(80, seed=5)
    cu = np.concatenate([[0], np.cumsum([len(m) for m in masks])])
    flat = np.concatenate(masks)
    sup, cand = anchors.mask_counts(flat, cu)
    k = anchors.anchor_counts(cand, sup, 9)
    d = anchor_digest.selection_digest(cand, k, seed=0, epoch=0)
    assert d.startswith(anchor_digest.DIGEST_PREFIX)
    assert d == anchor_digest.selection_digest(cand, k, seed=0, epoch=0)
    assert d != anchor_digest.selection_digest(cand, k, seed=0, epoch=1)
    assert d != anchor_digest.selection_digest(cand, k, seed=1, epoch=0)
    k2 = k.copy()
    k2[np.argmax(k)] -= 1
    assert d != anchor_digest.selection_digest(cand, k2, seed=0, epoch=0)
    # the digest of the positions regenerated from the masks is the digest of the counts' draw
    ids = np.arange(80)
    pos, off = anchors.sample_anchors_batch(flat, cu, ids, seed=0, epoch=0, max_anchors=9)
    dg = anchor_digest.AnchorDigest(80)
    dg.update(anchor_digest.position_hashes(flat[:cu[30]], cu[:31], ids[:30], pos[:off[30]], off[:31]))    # in chunks
    dg.update(anchor_digest.position_hashes(flat[cu[30]:], cu[30:] - cu[30], ids[30:], pos[off[30]:], off[30:] - off[30]))
    assert dg.hexdigest() == d
    # ... and a single position moved (still eligible) changes it
    i = next(i for i in range(80) if 0 < off[i + 1] - off[i] < cand[i])
    e = np.flatnonzero(masks[i][:-1].astype(bool) & masks[i][1:].astype(bool))
    moved = pos.copy()
    moved[off[i]] = next(int(a) for a in e if a not in pos[off[i]:off[i + 1]])
    moved[off[i]:off[i + 1]].sort()
    assert anchor_digest.position_hashes(flat, cu, ids, moved, off)[i] != anchor_digest.position_hashes(flat, cu, ids, pos, off)[i]


def test_digest_job_threads_and_chunks_agree():
    rng = np.random.default_rng(8)
    cand = rng.integers(0, 3000, 50_000).astype(np.int32)
    sup = (cand + rng.integers(0, 3, len(cand))).astype(np.int32)
    k = anchors.anchor_counts(cand, sup, 512)
    one = anchor_digest.DigestJob(cand, k, seed=4, epoch=2, background=False).result()
    for chunk in (1000, 4096, 1 << 22):
        assert anchor_digest.DigestJob(cand, k, seed=4, epoch=2, chunk=chunk).result() == one
    job = anchor_digest.DigestJob(cand, k, seed=4, epoch=2, chunk=100)
    job.cancel()                                   # stops, and a later result() refuses a partial digest
    with pytest.raises(ConfigError, match="fed"):
        job.result()
    with pytest.raises(ConfigError, match="0..candidates"):
        anchor_digest.DigestJob(cand, cand + 1, seed=0, epoch=0)


def test_bad_options():
    m = np.ones(10, np.uint8)
    with pytest.raises(ConfigError, match="anchor-policy"):
        anchors.sample_anchors(m, seed=0, epoch=0, sample_id=0, max_anchors=4, policy="all")
    with pytest.raises(ConfigError, match="max-anchors"):
        anchors.anchor_counts([3], [4], 0)
    with pytest.raises(ConfigError, match="cu_seqlens"):
        anchors.sample_anchors_batch(m, np.array([0, 4]), np.array([0, 1]), seed=0, epoch=0, max_anchors=2)


def test_ineligible_finds_bad_positions():
    masks = _masks(30, seed=6)
    cu = np.concatenate([[0], np.cumsum([len(m) for m in masks])])
    flat = np.concatenate(masks)
    pos, off = anchors.sample_anchors_batch(flat, cu, np.arange(30), seed=0, epoch=0, max_anchors=6)
    assert len(anchors.ineligible(flat, cu, pos, off)) == 0
    i = int(np.flatnonzero(np.diff(off) >= 2)[0])
    dup = pos.copy()
    dup[off[i] + 1] = dup[off[i]]                       # a repeated position
    assert anchors.ineligible(flat, cu, dup, off).tolist() == [i]
    j = int(np.flatnonzero(np.diff(off) >= 1)[-1])
    m = masks[j]
    off_mask = np.flatnonzero(~(m[:-1].astype(bool) & m[1:].astype(bool)))
    if len(off_mask):
        moved = pos.copy()
        moved[off[j + 1] - 1] = off_mask[-1]
        assert j in anchors.ineligible(flat, cu, moved, off).tolist()

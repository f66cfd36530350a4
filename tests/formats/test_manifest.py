"""manifest.py: the loader contract the trainer codes against, and verify's failure modes."""

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats import lengths, manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth import profiles
from dflash_prep.verify import verify_epoch


def _plan(tmp: Path, n=3000, seed=0) -> Path:
    np.save(tmp / "lengths.npy", profiles.make_lengths("bimodal", n=n, seed=seed))
    src = lengths.load(lengths_file=tmp / "lengths.npy")
    p = plan_mod.Plan(data=src.describe(), boundaries=(300, 2500), budget=plan_mod.Budget(value=16384), window=64)
    return plan_mod.save(p, tmp / "plan.json")


@pytest.fixture(params=["padded", "varlen"])
def packed(request, tmp_path):
    plan_path = _plan(tmp_path)
    dirs = pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "m", world_size=4, grad_accum=2,
                       layout=request.param, drop_last=True)
    return tmp_path, plan_path, dirs


def _rewrite(path: Path, **changes):
    """Re-write an epoch with changed arrays but consistent hashes: only verify's semantic checks can catch it."""
    m = manifest.open(path)
    arrays = {k: np.array(v) for k, v in m.arrays.items()}
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "fingerprint", "format", "version")}
    for k, fn in changes.items():
        fn(arrays[k])
    manifest.write(path, header, arrays, overwrite=True)


def test_contract(packed):
    tmp, plan_path, dirs = packed
    assert manifest.epoch_dir(tmp / "m", 1) == tmp / "m" / "epoch-0001" == dirs[1]
    m = manifest.open(dirs[1], plan_fingerprint=plan_mod.load(plan_path).fingerprint)
    assert (m.epoch, m.world_size, m.grad_accum) == (1, 4, 2)
    assert m.num_steps * 8 == m.num_microbatches and m.summary["steps"] == m.num_steps
    seen = []
    for rank in range(4):
        mbs = list(m.microbatches(rank))
        assert len(mbs) == 2 * m.num_steps
        assert [(b.step, b.accum) for b in mbs] == [(s, a) for s in range(m.num_steps) for a in range(2)]
        for b in mbs:
            assert b.rank == rank and b.sample_ids.dtype == np.int64 and len(b.sample_ids) == len(b.sample_lens)
            assert b.real_tokens == int(b.sample_lens.sum())
            if m.layout == "varlen":
                assert np.array_equal(b.cu_seqlens, np.concatenate([[0], np.cumsum(b.sample_lens)]))
                assert b.padded_tokens == b.real_tokens
            else:
                assert b.max_len == b.sample_lens.max() and b.padded_tokens == b.max_len * len(b.sample_ids)
            seen.append(b.sample_ids)
        resumed = list(m.microbatches(rank, start_step=3))
        assert [b.index for b in resumed] == [b.index for b in mbs[6:]]
    assert sum(m.step_real_tokens(s) for s in range(m.num_steps)) == m.summary["real_tokens"]
    assert len(np.concatenate(seen)) + len(m.dropped_ids) == 3000
    order, offsets = manifest.rows_to_batches(m.table, m.sample_ids)
    rows = [m.microbatch(i).sample_ids for i in range(m.num_microbatches)]
    assert np.array_equal(order, np.concatenate(rows)) and np.array_equal(np.diff(offsets), [len(r) for r in rows])


def test_open_errors(packed, tmp_path):
    _, _, dirs = packed
    with pytest.raises(FormatError, match="not found"):
        manifest.open(tmp_path / "nope")
    with pytest.raises(FingerprintMismatch, match="re-pack"):
        manifest.open(dirs[0], plan_fingerprint="0" * 32)
    m = manifest.open(dirs[0])
    with pytest.raises(ConfigError, match="rank 4"):
        next(m.microbatches(4))
    with pytest.raises(ConfigError, match="not elastic"):
        m.check_world(8, 1)
    m.check_world(4, 2)
    h = json.loads((dirs[0] / "manifest.json").read_text())
    (dirs[0] / "manifest.json").write_text(json.dumps(dict(h, version=99)))
    with pytest.raises(FormatError, match="version 99"):
        manifest.open(dirs[0])


def test_verify_passes_and_finds_lengths_itself(packed):
    _, _, dirs = packed
    got = verify_epoch(dirs[1])
    s = manifest.open(dirs[1]).summary
    for k in ("efficiency", "fill", "step_mix", "rank_imbalance", "repeat_pair_rate"):
        assert got[k] == pytest.approx(s[k], abs=1e-9), k


def test_verify_corrupt_and_truncated(packed):
    _, _, dirs = packed
    ids = dirs[0] / "sample_ids.npy"
    raw = bytearray(ids.read_bytes())
    raw[-3] ^= 0xFF
    ids.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="SHA-256"):
        verify_epoch(dirs[0])
    ids.write_bytes(bytes(raw[:-40]))
    with pytest.raises(FormatError, match="truncated"):
        verify_epoch(dirs[0])


def test_verify_wrong_data(packed, tmp_path):
    _, _, dirs = packed
    np.save(tmp_path / "other.npy", profiles.make_lengths("bimodal", n=3000, seed=5))
    with pytest.raises(FingerprintMismatch, match="fingerprint"):
        verify_epoch(dirs[0], lengths=tmp_path / "other.npy")


def _dup(a):
    a[1] = a[0]


def _over(t):
    t[0, manifest.COL["rank"]], t[1, manifest.COL["rank"]] = t[1, manifest.COL["rank"]], t[0, manifest.COL["rank"]] + 1


@pytest.mark.parametrize("change,match", [
    ({"sample_ids": _dup}, "missing"),
    ({"microbatches": _over}, "unequal counts"),
    ({"dropped_ids": lambda a: a.__setitem__(slice(None), a[::-1])}, None),
])
def test_verify_semantic_violations(packed, change, match):
    _, _, dirs = packed
    _rewrite(dirs[0], **change)
    if match is None:                            # a harmless reordering of the drop list still verifies
        verify_epoch(dirs[0])
        return
    with pytest.raises(FormatError, match=match):
        verify_epoch(dirs[0])


def test_verify_budget_exceeded(tmp_path):
    plan_path = _plan(tmp_path)
    [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", world_size=2)
    m = manifest.open(d)
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "fingerprint", "format", "version")}
    header["budget"] = dict(header["budget"], value=1000.0)
    manifest.write(d, header, {k: np.array(v) for k, v in m.arrays.items()}, overwrite=True)
    with pytest.raises(FormatError, match="exceed the budget"):
        verify_epoch(d)


def test_verify_summary_tampered(tmp_path):
    plan_path = _plan(tmp_path)
    [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", world_size=2)
    h = json.loads((d / "manifest.json").read_text())
    h["summary"]["efficiency"] = 0.999
    (d / "manifest.json").write_text(json.dumps(h))
    with pytest.raises(FormatError, match="efficiency"):
        verify_epoch(d)
    h["num_steps"] += 1
    (d / "manifest.json").write_text(json.dumps(h))
    with pytest.raises(FormatError):
        verify_epoch(d)


def test_epoch_dir_and_find_epochs(tmp_path):
    with pytest.raises(ConfigError, match=">= 0"):
        manifest.epoch_dir(tmp_path, -1)
    with pytest.raises(FormatError, match="no manifest"):
        manifest.find_epochs(tmp_path)

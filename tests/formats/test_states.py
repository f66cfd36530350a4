"""The states cache format (dflash_prep.formats.states): codecs and their error bounds, the shard
plan, shard files (atomic, memory-mapped, self-checking), and what open and verify refuse."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dflash_prep.errors import FormatError
from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_write_json


def _values(seed=0, n=64, s=3, h=96):
    """Rows of very different magnitudes, an all-zero row, subnormal-range entries and outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, s, h, generator=g) * torch.logspace(-6, 3, n)[:, None, None]
    x[5] = 0.0
    x[7, 1, :10] = 1e-12
    x[9, 2, 3] = 5e4
    return x


def test_fp8_error_bound_and_codecs_agree():
    x = _values()
    rows, scales = fmt.encode_torch(x, "fp8")
    assert rows.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == x.shape[:2]
    got_np = fmt.decode(rows, scales, "fp8")
    got_t = fmt.decode_torch(rows, scales, "fp8").numpy()
    assert np.array_equal(got_np, got_t), "numpy and torch decoders disagree"
    xs = x.numpy()
    bound = np.maximum(np.abs(xs) / 16, scales[..., None] / 1024) * (1 + 1e-6)
    err = np.abs(got_np - xs)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"fp8 error exceeds max(|x|/16, scale/1024): worst ratio {worst:.4f}, max err {err.max():.3g}"
    assert worst > 0.5, f"the bound is loose (worst ratio {worst:.3f}): the test would not see a worse rounding"
    assert np.array_equal(got_np[5], np.zeros_like(got_np[5])) and (scales[5] == 1.0).all()
    assert np.abs(got_np).max() <= np.abs(xs).max() * (1 + 1e-6)          # the scale keeps amax representable
    assert fmt.bytes_per_token(4, 4096, "fp8") / fmt.bytes_per_token(4, 4096, "bf16") == pytest.approx(0.5, abs=1e-3)


def test_bf16_and_fp32_round_trip():
    x = _values(1)
    rows, scales = fmt.encode_torch(x, "bf16")
    assert rows.dtype == np.uint16 and scales is None
    got = fmt.decode(rows, None, "bf16")
    assert np.array_equal(got, fmt.decode_torch(rows, None, "bf16").numpy())
    assert np.array_equal(got, x.to(torch.bfloat16).float().numpy())
    assert (np.abs(got - x.numpy()) <= np.abs(x.numpy()) * 2.0 ** -8).all()
    rows, _ = fmt.encode_torch(x, "fp32")
    assert np.array_equal(fmt.decode(rows, None, "fp32"), x.numpy())


def test_fp8_table_matches_torch():
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    want = b.view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(fmt.FP8_TABLE), nan)
    assert np.array_equal(fmt.FP8_TABLE[~nan], want[~nan])


def test_plan_shards_tiles_and_respects_the_size():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 300, 500).astype(np.int32)
    lens[17] = 5000                                          # one sample bigger than a shard: alone
    plan = fmt.plan_shards(lens, 100, 100_000)
    assert plan == fmt.plan_shards(lens, 100, 100_000)
    assert plan[0][0] == 0 and plan[-1][1] == len(lens) and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for a, b in plan:
        size = int(lens[a:b].sum()) * 100
        assert size <= 100_000 or b - a == 1, (a, b, size)
        if b < len(lens):
            assert size + int(lens[b]) * 100 > 100_000, "a shard closed while the next sample still fitted"
    assert (17, 18) in plan
    assert fmt.plan_shards(np.zeros(0, np.int32), 100, 1000) == []


def _key(dtype="bf16", final=True):
    return fmt.StatesKey(dataset_fingerprint="d" * 32, target_fingerprint="t" * 64, taps=(1, 2), final=final,
                         dtype=dtype, hidden=96)


def _write_cache(folder, dtype="bf16", lens=(5, 9, 1, 30, 12, 7), shard_tokens=20, seed=0, dataset=None):
    """A complete cache of random states (``dataset``: its fingerprint and path relative to the
    cache); returns the key, the float32 values per sample that went in, and the plan."""
    key = _key(dtype)
    if dataset is not None:
        key = fmt.StatesKey(**{**key.to_dict(), "taps": key.taps, "dataset_fingerprint": dataset[0]})
    lens = np.asarray(lens, np.int32)
    plan = fmt.plan_shards(lens, key.bytes_per_token(), shard_tokens * key.bytes_per_token())
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn(int(n), key.slots, key.hidden, generator=g) for n in lens]
    entries = []
    for k, (a, b) in enumerate(plan):
        x = torch.cat(vals[a:b])
        rows, scales = fmt.encode_torch(x, dtype)
        off = np.concatenate([[0], np.cumsum(lens[a:b])]).astype(np.int64)
        entries.append(fmt.write_shard(folder / fmt.shard_name(k), cache_fingerprint=key.fingerprint(), index=k,
                                       samples=(a, b), key=key, rows=rows, scales=scales, offsets=off))
    atomic_write_json(folder / fmt.HEADER_FILE, {"complete": True, "fingerprint": key.fingerprint(),
                                                 "key": key.to_dict(), "plan": [list(p) for p in plan],
                                                 "shards": entries, "command": "dflash-prep extract D --out C",
                                                 "dataset": {"path": dataset[1] if dataset else "?"}},
                      format=fmt.FORMAT, version=fmt.VERSION)
    return key, vals, plan


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
def test_cache_reads_back_by_sample_id(tmp_path, dtype):
    key, vals, plan = _write_cache(tmp_path, dtype)
    assert len(plan) > 2
    c = fmt.open_states(tmp_path)
    assert c.num_samples == len(vals) and c.key == key and c.slot_of(2) == 1 and c.final_slot == 2
    for sid in (3, 0, 5, 2):                                 # any order
        rows, scales = c.sample(sid)
        assert rows.shape == tuple(vals[sid].shape)
        enc = fmt.encode_torch(vals[sid], dtype)
        assert np.array_equal(rows, enc[0]) and (scales is None or np.array_equal(scales, enc[1]))
    with pytest.raises(FormatError, match="outside"):
        c.sample(len(vals))
    for sh in c.shards:                                      # arrays start on 4096-byte boundaries: mmap-friendly
        assert all(int(a["offset"]) % fmt.ALIGN == 0 for a in sh.head["arrays"].values())


def test_shard_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails at its last moment (the fsync) leaves no shard and no temp file."""
    key = _key("fp32")
    rows = np.zeros((4, key.slots, key.hidden), np.float32)

    def boom(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        fmt.write_shard(tmp_path / fmt.shard_name(0), cache_fingerprint="f", index=0, samples=(0, 2), key=key,
                        rows=rows, scales=None, offsets=np.array([0, 1, 4]))
    assert list(tmp_path.iterdir()) == []


def test_open_refuses_incomplete_truncated_and_replaced_shards(tmp_path):
    _write_cache(tmp_path)
    fmt.open_states(tmp_path)
    h = json.loads((tmp_path / fmt.HEADER_FILE).read_text())
    shard = tmp_path / fmt.shard_name(1)
    blob = shard.read_bytes()
    shard.write_bytes(blob[: len(blob) // 2])                # a non-atomic writer's leftovers, or a bad disk
    with pytest.raises(FormatError, match="truncated"):
        fmt.open_states(tmp_path)
    shard.write_bytes(blob)
    fmt.open_states(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _write_cache(other, seed=1)                              # same key and plan, other values: another build
    (tmp_path / fmt.shard_name(1)).write_bytes((other / fmt.shard_name(1)).read_bytes())
    with pytest.raises(FormatError, match="header digest"):
        fmt.open_states(tmp_path)
    shard.write_bytes(blob)
    atomic_write_json(tmp_path / fmt.HEADER_FILE, {**h, "complete": False}, format=fmt.FORMAT, version=fmt.VERSION)
    with pytest.raises(FormatError, match="incomplete.*dflash-prep extract"):
        fmt.open_states(tmp_path)


def test_verify_finds_a_flipped_byte_and_a_foreign_dataset(tmp_path):
    """open_states reads headers only; verify re-hashes every array, checks the lengths against the
    dataset the cache records, and every value."""
    from dflash_prep.formats.dataset import open_dataset
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    synth(SynthConfig(out=tmp_path / "corpus", n=12, seed=1, profile="mini"))
    tokenize(TokenizeConfig(inputs=(str(tmp_path / "corpus"),), out=tmp_path / "data", tokenizer="byte"))
    ds = open_dataset(tmp_path / "data")
    cache = tmp_path / "cache"
    cache.mkdir()
    _write_cache(cache, "fp8", lens=tuple(int(n) for n in ds.lengths), shard_tokens=600,
                 dataset=(ds.fingerprint, os.path.relpath(tmp_path / "data", cache)))
    r = fmt.verify_states(cache)
    assert r["samples"] == 12 and r["tokens"] == int(ds.lengths.sum()) and r["shards"] > 1
    shard = cache / fmt.shard_name(1)
    head, _ = fmt.read_shard_header(shard)
    blob = bytearray(shard.read_bytes())
    blob[int(head["arrays"]["rows"]["offset"]) + 777] ^= 0x10
    shard.write_bytes(bytes(blob))
    fmt.open_states(cache)                                   # headers intact: the trainer's cheap open passes
    with pytest.raises(FormatError, match=r"shard-00001.states: array rows does not match its SHA-256"):
        fmt.verify_states(cache)
    from dflash_prep.errors import FingerprintMismatch

    synth(SynthConfig(out=tmp_path / "corpus2", n=12, seed=2, profile="mini"))
    tokenize(TokenizeConfig(inputs=(str(tmp_path / "corpus2"),), out=tmp_path / "data2", tokenizer="byte"))
    with pytest.raises(FingerprintMismatch, match="built for dataset"):
        fmt.verify_states(cache, data=tmp_path / "data2")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_state_is_refused_at_write_naming_the_sample(tmp_path, dtype, bad):
    """Before this check an fp8 NaN made its row's scale 1 (the rest of the row clipped to +-448)
    and an infinity decoded to NaN or 0; every dtype now refuses the shard, naming the sample and
    the token, and writes nothing."""
    key = _key(dtype)
    lens = np.array([3, 5, 4])
    x = torch.randn(int(lens.sum()), key.slots, key.hidden, generator=torch.Generator().manual_seed(0))
    x[3 + 2, 1, 7] = bad                                     # sample 1 (id 10 + 1 in this shard), its token 2
    rows, scales = fmt.encode_torch(x, dtype)
    off = np.concatenate([[0], np.cumsum(lens)])
    with pytest.raises(FormatError) as e:
        fmt.write_shard(tmp_path / fmt.shard_name(4), cache_fingerprint="f", index=4, samples=(10, 13), key=key,
                        rows=rows, scales=scales, offsets=off)
    msg = str(e.value)
    assert "\n" not in msg and "shard 4: sample 11 has a non-finite hidden state" in msg and "token 2;" in msg, msg
    assert list(tmp_path.iterdir()) == []
    x[5, 1, 7] = 3.0e38 if dtype != "fp8" else 1e30          # finite, however large: written
    rows, scales = fmt.encode_torch(x, dtype)
    fmt.write_shard(tmp_path / fmt.shard_name(4), cache_fingerprint="f", index=4, samples=(10, 13), key=key,
                    rows=rows, scales=scales, offsets=off)


def test_the_finite_check_finds_the_first_bad_row_in_any_chunk(monkeypatch):
    monkeypatch.setattr(fmt, "CHECK_BYTES", 3 * 2 * 8 * 2)   # 2 rows of (2, 8) bf16 a pass: 6 passes
    rows = np.zeros((11, 2, 8), np.uint16)
    assert fmt.nonfinite_row(rows, None, "bf16") is None
    rows[9, 1, 5] = 0xFF80                                   # -inf
    rows[10, 0, 0] = 0x7FC1                                  # a NaN after it
    assert fmt.nonfinite_row(rows, None, "bf16") == 9
    rows[9, 1, 5] = 0x7F7F                                   # bf16's largest finite value
    assert fmt.nonfinite_row(rows, None, "bf16") == 10
    q = np.full((6, 2, 8), 0x7E, np.uint8)                   # e4m3fn 448, finite
    sc = np.ones((6, 2), np.float32)
    assert fmt.nonfinite_row(q, sc, "fp8") is None
    sc[4, 1] = np.inf
    assert fmt.nonfinite_row(q, sc, "fp8") == 4
    q[2, 0, 3] = 0xFF
    assert fmt.nonfinite_row(q, sc, "fp8") == 2


def test_verify_shard_finds_rows_overwritten_after_the_write(tmp_path):
    """64 bytes of 0x7f (bf16 0x7f7f: finite) pass every header check and the finite check; only the
    digest sees them."""
    _write_cache(tmp_path)
    c = fmt.open_states(tmp_path)
    for sh in c.shards:
        fmt.verify_shard(sh, c.command)
    shard = tmp_path / fmt.shard_name(1)
    head, _ = fmt.read_shard_header(shard)
    with open(shard, "r+b") as f:
        f.seek(int(head["arrays"]["rows"]["offset"]) + 256)
        f.write(b"\x7f" * 64)
    c = fmt.open_states(tmp_path)                            # the headers still match the table
    assert fmt.nonfinite_row(c.shards[1].rows, None, "bf16") is None
    with pytest.raises(FormatError, match=r"shard-00001.states: array rows does not match its SHA-256 .*"
                                          r"rerun dflash-prep extract D --out C"):
        fmt.verify_shard(c.shards[1], c.command)
    fmt.verify_shard(c.shards[0], c.command)

"""Foundation: atomic versioned files, length sources, plans, metrics vs brute force."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError, InputError
from dflash_prep.formats import fileio, lengths, plan
from dflash_prep.pack import metrics
from dflash_prep.synth import profiles


# ----------------------------------------------------------------------------- fileio
def test_atomic_json_roundtrip_and_header(tmp_path):
    p = tmp_path / "x.json"
    fileio.atomic_write_json(p, {"a": 1}, format="dflash-prep/test", version=1)
    assert fileio.read_json(p, format="dflash-prep/test") == {"format": "dflash-prep/test", "version": 1, "a": 1}
    with pytest.raises(FormatError, match="expected a 'dflash-prep/other' file"):
        fileio.read_json(p, format="dflash-prep/other")
    with pytest.raises(FormatError, match="version 1 is not supported"):
        fileio.read_json(p, format="dflash-prep/test", versions=(2,))
    p.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        fileio.read_json(p, format="dflash-prep/test")
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]  # no temp files left behind


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with fileio.atomic_dir(final) as d:
            (d / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with fileio.atomic_dir(final) as d:
        (d / "a").write_text("1")
    with pytest.raises(FormatError, match="--overwrite"):
        with fileio.atomic_dir(final) as d:
            pass
    with fileio.atomic_dir(final, overwrite=True) as d:
        (d / "b").write_text("2")
    assert sorted(f.name for f in final.iterdir()) == ["b"]
    assert [f.name for f in tmp_path.iterdir()] == ["out"]
    umask = os.umask(0)
    os.umask(umask)
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    fileio.atomic_write_bytes(tmp_path / "f", b"x")
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask


def test_truncated_npy_is_a_format_error(tmp_path):
    p = tmp_path / "a.npy"
    fileio.atomic_save_npy(p, np.arange(1000, dtype=np.int64))
    assert fileio.load_npy(p).sum() == 499500
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(FormatError, match="corrupt or truncated"):
        fileio.load_npy(p)


def test_fingerprints_are_stable_and_sensitive():
    a = np.arange(10, dtype=np.int32)
    assert fileio.fingerprint_array(a) == fileio.fingerprint_array(a.copy())
    assert fileio.fingerprint_array(a) != fileio.fingerprint_array(a.astype(np.int64))
    assert fileio.fingerprint_json({"a": 1, "b": 2}) == fileio.fingerprint_json({"b": 2, "a": 1})


# ----------------------------------------------------------------------------- lengths
def test_lengths_file_text_and_npy(tmp_path):
    t = tmp_path / "l.txt"
    t.write_text("5\n7\n\n9\n")
    src = lengths.load(lengths_file=t)
    assert src.lengths.tolist() == [5, 7, 9] and src.kind == "lengths" and src.total_tokens == 21
    n = tmp_path / "l.npy"
    np.save(n, np.array([5, 7, 9], dtype=np.int64))
    assert lengths.load(lengths_file=n).fingerprint == src.fingerprint


@pytest.mark.parametrize("content,match", [("5\nabc\n", r"l.txt:2: 'abc' is not an integer"),
                                           ("", "no samples"), ("5\n0\n", "at least one token")])
def test_lengths_file_bad_input(tmp_path, content, match):
    t = tmp_path / "l.txt"
    t.write_text(content)
    with pytest.raises(InputError, match=match):
        lengths.load(lengths_file=t)


def test_lengths_missing_sources(tmp_path):
    with pytest.raises(InputError, match="not found"):
        lengths.load(lengths_file=tmp_path / "nope.npy")
    with pytest.raises(InputError, match="tokenize"):
        lengths.load(data=tmp_path / "nope")
    with pytest.raises(InputError, match="exactly one"):
        lengths.load()


# ----------------------------------------------------------------------------- plan
def _plan(src, **kw):
    return plan.Plan(data=src.describe(), boundaries=(100, 200), budget=plan.Budget(value=4096), **kw)


def test_plan_roundtrip_fingerprint_and_tamper(tmp_path):
    src = lengths.LengthSource(np.array([50, 150, 250], np.int32), "lengths", "x", "fp0")
    p = plan.save(_plan(src, seed=3), tmp_path)
    got = plan.load(p)
    assert got.boundaries == (100, 200) and got.seed == 3 and got.fingerprint
    assert plan.load(plan.save(_plan(src, seed=4), tmp_path / "b")).fingerprint != got.fingerprint
    d = json.loads(p.read_text())
    d["seed"] = 99
    p.write_text(json.dumps(d))
    with pytest.raises(FingerprintMismatch, match="edited by hand"):
        plan.load(p)
    other = lengths.LengthSource(np.array([1], np.int32), "lengths", "y", "fp1")
    with pytest.raises(FingerprintMismatch, match="analyze"):
        got.check_data(other)


def test_plan_validation():
    src = lengths.LengthSource(np.array([5], np.int32), "lengths", "x", "fp")
    with pytest.raises(ConfigError, match="strictly increasing"):
        plan.Plan(data=src.describe(), boundaries=(200, 100), budget=plan.Budget())
    with pytest.raises(ConfigError, match="model-dim"):
        plan.Budget(unit="cost", value=10)
    with pytest.raises(ConfigError, match="positive"):
        plan.Budget(value=0)


def test_plan_missing_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="dflash-prep analyze"):
        plan.load(tmp_path / "plan.json")


# ----------------------------------------------------------------------------- metrics
def _brute(lens, batches_a, batches_b):
    pa = {frozenset(p) for b in batches_a for p in itertools.combinations(b, 2)}
    pb = {frozenset(p) for b in batches_b for p in itertools.combinations(b, 2)}
    eff = sum(lens[i] for b in batches_a for i in b) / sum(len(b) * max(lens[i] for i in b) for b in batches_a)
    return eff, len(pa & pb) / len(pa)


def _as_arrays(batches):
    order = np.array([i for b in batches for i in b], np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in batches])]).astype(np.int64)
    return order, offsets


def test_metrics_match_brute_force():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 50, 60)
    for _ in range(5):
        pa, pb = rng.permutation(60), rng.permutation(60)
        cuts_a = sorted(rng.choice(np.arange(1, 60), 9, replace=False))
        cuts_b = sorted(rng.choice(np.arange(1, 60), 9, replace=False))
        ba = [list(x) for x in np.split(pa, cuts_a)]
        bb = [list(x) for x in np.split(pb, cuts_b)]
        eff, rep = _brute(lens, ba, bb)
        oa, fa = _as_arrays(ba)
        ob, fb = _as_arrays(bb)
        assert metrics.efficiency(lens, oa, fa) == pytest.approx(eff)
        assert metrics.repeat_pair_rate(oa, fa, ob, fb, 60) == pytest.approx(rep)
    assert metrics.repeat_pair_rate(oa, fa, oa, fa, 60) == 1.0


def test_step_mix_and_rank_imbalance_by_hand():
    lens = np.array([10, 10, 30, 30], np.int64)
    edges = np.array([20])  # two classes, each holding... class shares judged against 1/2
    order, offsets = _as_arrays([[0, 1], [2, 3]])
    # one step holding both batches: shares 20/80 and 60/80 -> TV = 0.25
    assert metrics.step_mix(lens, order, offsets, np.array([0, 0]), edges=edges) == pytest.approx(0.25)
    # two steps, each pure: TV 0.5 each
    assert metrics.step_mix(lens, order, offsets, np.array([0, 1]), edges=edges) == pytest.approx(0.5)
    cost = metrics.batch_cost(lens, order, offsets, alpha=0.0)
    assert cost.tolist() == [20.0, 60.0]
    assert metrics.rank_imbalance(cost, np.array([0, 0]), np.array([0, 1]), 2) == pytest.approx(60 / 40 - 1)
    vcost = metrics.batch_cost(lens, order, offsets, alpha=0.1, varlen=True)
    assert vcost.tolist() == pytest.approx([2 * (10 + 10.0), 2 * (30 + 90.0)])


def test_int64_token_sums_do_not_overflow():
    # 300k samples of 8191 tokens: 2.46e9 tokens, beyond int32
    lens = np.full(300_000, 8191, np.int32)
    order = np.arange(300_000, dtype=np.int64)
    offsets = np.array([0, 150_000, 300_000], np.int64)
    counts, real, mx = metrics.batch_stats(lens, order, offsets)
    assert real.sum() == 300_000 * 8191
    assert metrics.efficiency(lens, order, offsets) == 1.0


def test_seedlike_profile_matches_design():
    lens = profiles.make_lengths("seedlike")
    assert len(lens) == 902_087
    assert 1140 <= np.median(lens) <= 1165 and 1370 <= lens.mean() <= 1410
    assert 4800 <= np.percentile(lens, 99) <= 5000
    assert lens.min() == 65 and lens.max() == 8191
    edges = metrics.class_edges(lens)
    design = np.array([830, 1106, 1372, 1665, 2021, 2512, 3388])
    assert np.all(np.abs(edges - design) <= 0.01 * design)
    np.testing.assert_array_equal(lens, profiles.make_lengths("seedlike"))
    with pytest.raises(ConfigError, match="unknown length profile"):
        profiles.make_lengths("nope")


def test_mini_profile_is_seedlike_at_a_quarter():
    mini = profiles.make_lengths("mini", 50_000)
    seed = profiles.make_lengths("seedlike", 50_000)
    assert 16 <= mini.min() and mini.max() <= 2048
    assert abs(np.median(mini) - np.median(seed) / 4) <= 2


def test_dataset_lengths_are_checked_against_meta(tmp_path):
    lens = np.array([5, 7, 9], np.int32)
    fileio.atomic_save_npy(tmp_path / "lengths.npy", lens)
    fileio.atomic_write_json(tmp_path / "meta.json", {"fingerprint": "d0", "counts": {"samples": 3},
                                                      "lengths": {"fingerprint": fileio.fingerprint_array(lens)}},
                             format=lengths.DATASET_FORMAT, version=1)
    assert lengths.load(data=tmp_path).fingerprint == "d0"
    fileio.atomic_save_npy(tmp_path / "lengths.npy", np.array([5, 7, 8], np.int32))
    with pytest.raises(FormatError, match="do not match the fingerprint"):
        lengths.load(data=tmp_path)


def test_fill_under_a_cost_budget_is_counted_in_cost():
    lens = np.array([100, 100, 50], np.int64)
    order, offsets = np.arange(3), np.array([0, 2, 3])
    alpha = 0.01  # cost(100) = 200, cost(50) = 75
    assert metrics.fill(lens, order, offsets, 400.0, alpha=alpha) == pytest.approx((2 * 200 + 75) / (2 * 400))
    assert metrics.fill(lens, order, offsets, 400.0) == pytest.approx((200 + 50) / 800)


def test_efficiency_and_fill_in_one_pass_equal_the_separate_metrics():
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 500, 400)
    order = rng.permutation(400)
    offsets = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 400), 30, replace=False)), [400]])
    for alpha in (0.0, 0.002):
        eff, fl = metrics.efficiency_and_fill(lens, order, offsets, 5000.0, alpha=alpha)
        assert eff == pytest.approx(metrics.efficiency(lens, order, offsets))
        assert fl == pytest.approx(metrics.fill(lens, order, offsets, 5000.0, alpha=alpha))

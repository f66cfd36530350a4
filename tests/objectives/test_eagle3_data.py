"""pack / analyze / verify --objective eagle3: the token counts, the draft vocabulary map, the step cost."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep.cli import app
from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_dataset_lengths
from dflash_prep.objectives import options
from dflash_prep.objectives.drafter_cost import Eagle3CostModel
from dflash_prep.objectives.eagle3 import Eagle3Options, load_vocab_map
from dflash_prep.formats import token_counts as counts_mod
from dflash_prep.objectives.eagle3 import vocab_map
from dflash_prep.pack import metrics
from dflash_prep.pack.config import load as load_pack_config
from dflash_prep.pack.pack import PackConfig, pack_epochs
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.verify import verify_epoch

from dflash_prep.tests.assets.fixtures import write_jsonl

T = 2048
DIMS = "hidden=256,layers=8,intermediate=768,heads=4,kv_heads=2,head_dim=64,vocab=1000"
J, Q, Z = ord("J"), ord("Q"), ord("Z")       # byte ids 74 < 81 < 90: always trained on together, a tie


def _make_dataset(folder: Path, n: int = 90, seed: int = 0) -> Path:
    """Byte-tokenized chats whose answers are ``"QJZ" * n1 + "ab" * n2 + "c" * n3``: J, Q and Z
    tie (as do a and b), and only the answers and their end-of-turn tokens are trained on."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        n1, n2, n3 = (int(x) for x in rng.integers(1, 30, 3))
        answer = "QJZ" * n1 + "ab" * n2 + "c" * n3 + " ok"
        rows.append({"messages": [{"role": "user", "content": "hello there"},
                                  {"role": "assistant", "content": answer}]})
    folder.mkdir(parents=True, exist_ok=True)
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(write_jsonl(folder / "chat.jsonl", rows)),),
                            out=folder / "data", chunk_rows=25))
    return folder / "data"


def _plan(data: Path, where: Path) -> Path:
    src = read_dataset_lengths(data)
    return plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=T), seed=3),
                         where)


def _brute_counts(data: Path) -> np.ndarray:
    """The loss's target tokens, one position at a time: ids[t] where loss_mask[t] = 1, t >= 1."""
    ds = open_dataset(data)
    c = np.zeros(int(ds.tokenizer_info["vocab_size"]), np.int64)
    for i in range(len(ds)):
        ids, mask = ds.sample(i)
        for t in range(1, len(ids)):
            if mask[t]:
                c[int(ids[t])] += 1
    return c


def _brute_map(c: np.ndarray, dv: int) -> tuple[np.ndarray, np.ndarray]:
    chosen = sorted(sorted(range(len(c)), key=lambda v: (-int(c[v]), v))[:dv])
    t2d = np.zeros(len(c), bool)
    t2d[chosen] = True
    return np.asarray(chosen, np.int64) - np.arange(dv), t2d


def _opts(**kw) -> Eagle3Options:
    return options.from_flags(Eagle3Options, options.PACK, {"target_dims": DIMS, "draft_vocab_size": 12, **kw})


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    data = _make_dataset(root)
    return data, _plan(data, root / "plan")


def test_count_kernel_skips_position_zero_and_unmasked_tokens():
    ids = np.array([5, 5, 6, 7, 5, 5, 2], np.int32)        # two samples: [5 5 6 7] and [5 5 2]
    mask = np.array([1, 1, 1, 0, 1, 0, 1], np.uint8)
    off = np.array([0, 4, 7], np.int32)
    hist = np.zeros((3, 8), np.int64)
    assert (counts_mod._count_batch(ids, mask, off, np.int64(8), hist) < 0).all()
    assert hist.sum(axis=0).tolist() == [0, 0, 1, 0, 0, 1, 1, 0]     # 5 (pos 1), 6 (pos 2), 2 (pos 6)
    bad = np.zeros((2, 8), np.int64)
    assert counts_mod._count_batch(ids, mask, off, np.int64(6), bad).max() == 2   # id 6 at flat position 2


def test_counts_and_map_equal_a_brute_force_count_ties_included(planned):
    data, _ = planned
    want = _brute_counts(data)
    got = counts_mod.count_target_tokens(open_dataset(data))
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert want[J] == want[Q] == want[Z] > 0 and want[ord("a")] == want[ord("b")]
    tie = int(want[J])
    above = int((want > tie).sum())
    for dv in {1, max(above, 1), above + 1, above + 2, above + 3, int(np.count_nonzero(want)), len(want)}:
        vm = vocab_map.build(want, dv)
        d2t, t2d = _brute_map(want, dv)
        assert vm.d2t.dtype == np.int64 and vm.t2d.dtype == np.bool_
        assert np.array_equal(vm.d2t, d2t) and np.array_equal(vm.t2d, t2d), dv
        assert np.array_equal(vm.target_ids, np.flatnonzero(t2d)) and (np.diff(vm.d2t) >= 0).all()
    vm = vocab_map.build(want, above + 1)                # the cut splits the J/Q/Z tie: the lowest id wins
    assert vm.t2d[J] and not vm.t2d[Q] and not vm.t2d[Z]
    vm = vocab_map.build(want, above + 2)
    assert vm.t2d[J] and vm.t2d[Q] and not vm.t2d[Z]
    assert vm.coverage == pytest.approx(want[vm.t2d].sum() / want.sum())


def test_fewer_trained_ids_than_the_draft_vocabulary(planned, tmp_path):
    data, plan_path = planned
    c = _brute_counts(data)
    trained = int(np.count_nonzero(c))
    vm = vocab_map.build(c, trained + 5)
    never = np.flatnonzero(c == 0)[:5]                   # the lowest never-trained ids fill the rest
    assert vm.trained_ids == trained
    assert np.array_equal(np.flatnonzero(vm.t2d), np.sort(np.r_[np.flatnonzero(c), never]))
    res = CliRunner().invoke(app, ["pack", str(data), "--plan", str(plan_path), "--out", str(tmp_path / "m"),
                                   "--epoch", "0", "--objective", "eagle3", "--target-dims", DIMS,
                                   "--draft-vocab-size", str(trained + 5)])
    assert res.exit_code == 0, res.output
    assert f"only {trained} token ids are ever trained on" in res.output
    assert f"--draft-vocab-size {trained}" in res.output
    m = manifest.open(tmp_path / "m" / "epoch-0000")
    assert m.header["eagle3"]["trained_ids"] == trained and m.summary["trained_ids"] == trained
    V = len(c)
    with pytest.raises(ConfigError, match=f"--draft-vocab-size {V + 1} exceeds the target vocabulary of {V} ids"):
        vocab_map.build(c, V + 1)
    with pytest.raises(ConfigError, match="--draft-vocab-size 2000 exceeds the target vocabulary 1000"):
        _opts(draft_vocab_size=2000)


def test_step_cost_by_hand():
    """a L + b L^2, with the attention pairs of every pass counted one query at a time."""
    H, Lt, I, h, kv, d, V, Vd, S = 32, 3, 48, 4, 2, 8, 50, 20, 3
    cm = Eagle3CostModel(hidden=H, layers=Lt, intermediate=I, heads=h, kv_heads=kv, head_dim=d, vocab=V,
                         draft_vocab=Vd, ttt_steps=S)
    layer = 2 * H * h * d + 2 * H * kv * d + 3 * H * I
    eagle_layer = 2 * H * h * d + 2 * (2 * H * kv * d) + h * d * H + 3 * H * I   # q, k, v read [embed, hidden]
    for L in (1, 5, 17):
        pairs = sum((i + 1) + j for j in range(S) for i in range(L))              # causal + j diagonal keys
        want = (2 * Lt * layer * L + 2 * h * d * Lt * L * L                        # target forward, 4hdL^2/2 per layer
                + 2 * H * V * L                                                    # target head: the soft labels
                + 6 * 3 * H * H * L                                                # fc 3H -> H, once
                + 6 * S * eagle_layer * L + 6 * S * H * Vd * L                     # S passes: layer, draft head
                + 12 * h * d * pairs)                                              # their attention
        assert cm.batch_cost([L], [L * L])[0] == pytest.approx(want, rel=1e-12), L
    assert cm.describe()["coefficients"] == cm.coefficients() and cm.of_record(cm.describe()) == cm
    assert cm.draft_params == 3 * H * H + eagle_layer + H * Vd


def test_pack_eagle3_deterministic_exactly_once_in_budget_and_priced_by_the_cost(planned, tmp_path):
    data, plan_path = planned
    cfg = PackConfig(objective="eagle3", options=_opts(), world_size=2, grad_accum=2)
    dirs = pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "a", config=cfg)
    pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "b", config=cfg)
    assert _files(tmp_path / "a") == _files(tmp_path / "b"), "two packs differ"
    assert load_pack_config(tmp_path / "a") == cfg.resolve(plan_mod.load(plan_path))
    lens = np.asarray(read_dataset_lengths(data).lengths, np.int64)
    cm = _opts().step_cost_model()
    a, b = cm.coefficients()["tokens"], cm.coefficients()["tokens_sq"]
    lm = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "lm",
                     config=PackConfig(objective="lm", layout="varlen", world_size=2, grad_accum=2))
    for d in dirs:
        m = manifest.open(d)
        t, c = np.asarray(m.table), manifest.COL
        assert m.layout == "varlen" and m.header["options"]["objective"] == "eagle3"
        assert np.array_equal(np.sort(m.sample_ids), np.arange(len(lens)))
        assert t[:, c["real_tokens"]].max() <= T
        cost = a * t[:, c["real_tokens"]].astype(float) + b * t[:, c["sum_sq_len"]].astype(float)   # by hand
        assert metrics.rank_imbalance(cost, t[:, c["step"]], t[:, c["rank"]], 2) == pytest.approx(
            m.summary["rank_imbalance"], abs=1e-12)
        got = verify_epoch(d)
        assert got["rank_imbalance"] == pytest.approx(m.summary["rank_imbalance"], abs=1e-12)
        assert got["trained_ids"] == m.summary["trained_ids"] and m.summary["rank_imbalance_cost"] == "eagle3"
        vm = load_vocab_map(m)
        assert np.array_equal(vm.d2t, _brute_map(_brute_counts(data), 12)[0])
    # the varlen packer's micro-batches, exactly: only their ranks follow the EAGLE-3 cost
    def batches(d):
        m = manifest.open(d)
        return sorted(tuple(sorted(m.sample_ids[s:s + n].tolist())) for s, n in m.table[:, [0, 1]])
    assert batches(dirs[0]) == batches(lm[0])


def test_verify_refuses_an_edited_map_and_edited_counts(planned, tmp_path):
    data, plan_path = planned
    [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", config=PackConfig(objective="eagle3",
                                                                                        options=_opts()))
    m = manifest.open(d)
    # an array edited in place: its hash names it
    bad = tmp_path / "inplace" / "epoch-0000"
    shutil.copytree(d, bad)
    d2t = np.array(m.arrays["d2t"])
    d2t[-1] += 1
    np.save(bad / "d2t.npy", d2t)
    with pytest.raises(FormatError, match="d2t.npy"):
        verify_epoch(bad, data=data)
    # a map edited and re-sealed (the manifest's hashes recomputed): the rebuilt map names it
    arrays = {k: np.array(v) for k, v in m.arrays.items()}
    arrays["t2d"][np.flatnonzero(arrays["t2d"])[0]] = False
    arrays["t2d"][np.flatnonzero(~arrays["t2d"])[-1]] = True
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "fingerprint", "format", "version")}
    manifest.write(tmp_path / "sealed" / "epoch-0000", header, arrays)
    with pytest.raises(FormatError, match=r"t2d\.npy: differs in 2 entries"):
        verify_epoch(tmp_path / "sealed" / "epoch-0000", data=data)
    # edited counts beside the dataset, even with their JSON made to vouch for them
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    counts = np.array(np.load(copy / counts_mod.COUNTS_FILE))
    counts[ord("c")] += 1
    np.save(copy / counts_mod.COUNTS_FILE, counts)
    with pytest.raises(FormatError, match=r"token_counts\.npy: differs from the counts of the shards in 1 ids"):
        verify_epoch(d, data=copy)
    meta = json.loads((copy / counts_mod.COUNTS_META).read_text())
    meta["counts"]["fingerprint"] = counts_mod.fingerprint_array(counts)
    (copy / counts_mod.COUNTS_META).write_text(json.dumps(meta))
    res = CliRunner().invoke(app, ["verify", str(d), "--data", str(copy)])
    assert res.exit_code == 1
    [line] = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert str(copy / counts_mod.COUNTS_FILE) in line and "differs from the counts of the shards" in line


def test_counts_are_reused_then_recounted_when_the_dataset_changes(tmp_path, monkeypatch):
    calls = []
    real = counts_mod.count_target_tokens
    monkeypatch.setattr(counts_mod, "count_target_tokens", lambda ds: calls.append(ds.fingerprint) or real(ds))
    data = _make_dataset(tmp_path / "one", n=40, seed=1)
    plan_path = _plan(data, tmp_path / "plan1")
    cfg = PackConfig(objective="eagle3", options=_opts())
    pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m1", config=cfg)
    assert len(calls) == 1
    before = (data / counts_mod.COUNTS_META).stat().st_mtime_ns, (data / counts_mod.COUNTS_FILE).read_bytes()
    pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "m2", config=cfg)       # another root: reused
    assert len(calls) == 1 and counts_mod.token_counts(data).reused
    assert before == ((data / counts_mod.COUNTS_META).stat().st_mtime_ns, (data / counts_mod.COUNTS_FILE).read_bytes())
    # other data in the same folder, the old counts files left beside it: they are stale, recounted
    old = {n: (data / n).read_bytes() for n in (counts_mod.COUNTS_FILE, counts_mod.COUNTS_META)}
    shutil.rmtree(tmp_path / "one")
    data = _make_dataset(tmp_path / "one", n=40, seed=2)
    for n, b in old.items():
        (data / n).write_bytes(b)
    plan_path = _plan(data, tmp_path / "plan2")
    [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m3", config=cfg)
    assert len(calls) == 2 and calls[1] == open_dataset(data).fingerprint != calls[0]
    meta = json.loads((data / counts_mod.COUNTS_META).read_text())
    assert meta["format"] == counts_mod.COUNTS_FORMAT and meta["dataset_fingerprint"] == calls[1]
    assert np.array_equal(np.load(data / counts_mod.COUNTS_FILE), _brute_counts(data))
    verify_epoch(d)


def test_files_not_ours_are_never_overwritten(tmp_path):
    data = _make_dataset(tmp_path, n=20, seed=3)
    (data / counts_mod.COUNTS_FILE).unlink(missing_ok=True)
    user = np.arange(5)
    np.save(data / counts_mod.COUNTS_FILE, user)                 # a user's file, no JSON of ours beside it
    with pytest.raises(ConfigError, match="was not written by dflash-prep"):
        counts_mod.token_counts(data)
    assert np.array_equal(np.load(data / counts_mod.COUNTS_FILE), user)


def test_cli_pack_verify_and_analyze_eagle3(planned, tmp_path):
    data, plan_path = planned
    runner = CliRunner()
    res = runner.invoke(app, ["pack", str(data), "--plan", str(plan_path), "--out", str(tmp_path / "m"), "--epochs",
                              "0-1", "--world-size", "2", "--objective", "eagle3", "--target-dims", DIMS,
                              "--draft-vocab-size", "10", "--ttt-steps", "3"])
    assert res.exit_code == 0, res.output
    h = manifest.open(tmp_path / "m" / "epoch-0001").header["eagle3"]
    assert (h["draft_vocab_size"], h["ttt_steps"], h["vocab_size"]) == (10, 3, 259) and h["map_version"] == 1
    assert h["cost_model"]["ttt_steps"] == 3 and "lower id" in h["tie_rule"]
    res = runner.invoke(app, ["verify", str(tmp_path / "m")])
    assert res.exit_code == 0 and "2 epoch(s) verified" in res.output, res.output
    res = runner.invoke(app, ["pack", str(data), "--plan", str(plan_path), "--out", str(tmp_path / "x"), "--epoch",
                              "0", "--objective", "dflash", "--target-dims", DIMS, "--ttt-steps", "3"])
    assert res.exit_code == 2 and "--ttt-steps is an option of --objective eagle3" in " ".join(res.output.split())
    res = runner.invoke(app, ["analyze", str(data), "--out", str(tmp_path / "an"), "--budget", "1024", "--json",
                              "--no-plot", "--objective", "eagle3", "--target-dims", DIMS, "--draft-vocab-size", "32",
                              "--buckets", "2"])
    assert res.exit_code == 0, res.output
    pred = json.loads(res.stdout)["eagle3"]
    [d] = pack_epochs(plan=tmp_path / "an" / "plan.json", epochs=[0], out=tmp_path / "p",
                      config=PackConfig(objective="eagle3", options=_opts(draft_vocab_size=32)))
    s = manifest.open(d).summary
    assert pred["microbatches"] == s["microbatches"] and pred["token_fill"] == pytest.approx(s["fill"], abs=1e-12)
    assert 0 < pred["drafter_cost_share"] < 1 and pred["rank_imbalance"] >= 0

"""Drafter data: tokenize's mask counts, pack --objective dflash, verify of anchors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dflash_prep.errors import FormatError
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_mask_counts
from dflash_prep.objectives import anchor_digest, anchors
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

from dflash_prep.tests.assets.fixtures import CHATS, write_jsonl


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A byte-tokenized chat dataset: the fixture chats repeated with varied lengths."""
    tmp = tmp_path_factory.mktemp("drafter")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(240):
        c = CHATS[i % len(CHATS)]
        rows.append({"messages": [dict(m, content=m["content"] * int(rng.integers(1, 12))) for m in c]})
    f = write_jsonl(tmp / "chat.jsonl", rows)
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(f),), out=tmp / "data", chunk_rows=50))
    return tmp / "data"


def test_tokenize_records_mask_counts(dataset):
    mc = read_mask_counts(dataset)
    ds = open_dataset(dataset)
    for i in range(len(ds)):
        _, mask = ds.sample(i)
        assert (int(mc.supervised[i]), int(mc.anchor_candidates[i])) == anchors.mask_counts(mask)
    assert mc.anchor_candidates.sum() > 0


def test_old_dataset_without_mask_counts_says_retokenize(dataset, tmp_path):
    import shutil
    old = tmp_path / "old"
    shutil.copytree(dataset, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["anchor_candidates"]                  # a folder tokenized before drafter support, re-sealed
    from dflash_prep.formats.dataset import meta_fingerprint
    meta["meta_fingerprint"] = meta_fingerprint(meta)
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="--overwrite"):
        read_mask_counts(old)
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    np.save(bad / "supervised.npy", np.asarray(np.load(bad / "supervised.npy")) + 1)
    with pytest.raises(FormatError, match="does not match"):
        read_mask_counts(bad)


from dflash_prep.errors import ConfigError  # noqa: E402
# ----------------------------------------------------------------------------- pack --objective dflash
from dflash_prep.formats import manifest  # noqa: E402
from dflash_prep.formats import plan as plan_mod  # noqa: E402
from dflash_prep.formats.lengths import read_dataset_lengths  # noqa: E402
from dflash_prep.objectives.dflash import DrafterOptions, drafter_options  # noqa: E402
from dflash_prep.objectives.dflash_anchors import microbatch_anchors  # noqa: E402
from dflash_prep.objectives.drafter_cost import DrafterCostModel  # noqa: E402
from dflash_prep.pack.config import load as load_pack_config  # noqa: E402
from dflash_prep.pack.pack import PackConfig, pack_epochs  # noqa: E402
from dflash_prep.verify import verify_epoch

T = 8192
QWEN_LIKE = {"hidden_size": 256, "num_hidden_layers": 8, "intermediate_size": 768, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "model_type": "qwen3"}


@pytest.fixture(scope="module")
def planned(dataset):
    src = read_dataset_lengths(dataset)
    p = plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=T), seed=5)
    path = plan_mod.save(p, dataset.parent / "plan")
    (dataset.parent / "target").mkdir(exist_ok=True)
    (dataset.parent / "target" / "config.json").write_text(json.dumps(QWEN_LIKE))
    return path, src


def _cfg(dataset, **kw):
    d = drafter_options(target_config=dataset.parent / "target", draft_layers=2, max_anchors=kw.pop("max_anchors", 24),
                        **{k: kw.pop(k) for k in list(kw) if k in DrafterOptions.__dataclass_fields__})
    return PackConfig(objective="dflash", options=d, **{"world_size": 4, **kw})


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@pytest.mark.parametrize("policy", ["cap", "density"])
def test_pack_dflash_budgets_ranks_anchors_and_verify(dataset, planned, tmp_path, policy):
    plan_path, src = planned
    cfg = _cfg(dataset, anchor_policy=policy, store_anchors=True, anchor_budget=200)
    dirs = pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "a", config=cfg)
    again = pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "b", config=cfg)
    assert _files(tmp_path / "a") == _files(tmp_path / "b"), "two runs differ"
    mc, ds = read_mask_counts(dataset), open_dataset(dataset)
    lens = np.asarray(src.lengths, np.int64)
    for e, d in enumerate(dirs):
        m = manifest.open(d)
        h, t, c = m.header["dflash"], m.table, manifest.COL
        assert m.layout == "varlen" and h["anchor_policy"] == policy and h["anchor_seed"] == 5
        assert h["block_size"] == 16 and h["max_anchors"] == 24 and h["anchor_budget"] == 200
        assert h["cost_model"]["hidden"] == 256 and h["cost_model"]["draft_layers"] == 2
        assert np.array_equal(np.sort(m.sample_ids), np.arange(len(lens)))
        k = np.asarray(m.arrays["anchor_counts"])
        pos = np.asarray(m.arrays["anchors"])
        off = np.concatenate([[0], np.cumsum(k)])
        for j, i in enumerate(m.sample_ids):          # every stored anchor is the sampler's
            want = anchors.sample_anchors(ds.sample(int(i))[1], seed=5, epoch=e, sample_id=int(i), max_anchors=24,
                                          policy=policy)
            assert np.array_equal(pos[off[j]:off[j + 1]], want)
        row_k = np.array([k[s:s + n].sum() for s, n in zip(t[:, c["start"]], t[:, c["count"]])])
        assert t[:, c["real_tokens"]].max() <= T and row_k.max() <= 200
        per_rank = np.bincount(t[:, c["step"]] * 4 + t[:, c["rank"]])
        assert np.all(per_rank == 1)
        s = m.summary
        assert s["useful_target_tokens"] == 1.0 and s["useful_anchor_slots"] == 1.0 and s["anchors"] == k.sum()
        got = verify_epoch(d)
        assert got["rank_imbalance"] == pytest.approx(s["rank_imbalance"], abs=1e-12)
        assert set(got["unchecked"]) <= {"predicted_efficiency", "split_microbatches"}, got["unchecked"]  # fills too
        mb = m.microbatch(1)                           # what the trainer regenerates per micro-batch
        masks = [ds.sample(int(i))[1] for i in mb.sample_ids]
        got_pos, got_off = microbatch_anchors(m.header, np.concatenate(masks), mb.cu_seqlens, mb.sample_ids)
        st = int(t[1, c["start"]])
        assert np.array_equal(got_pos, pos[off[st]:off[st + len(masks)]])
    assert not np.array_equal(manifest.open(dirs[0]).sample_ids, manifest.open(dirs[1]).sample_ids)
    assert load_pack_config(tmp_path / "a") == cfg.resolve(plan_mod.load(plan_path))


def test_verify_catches_wrong_anchors(dataset, planned, tmp_path):
    plan_path, _ = planned
    [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "m", config=_cfg(dataset, store_anchors=True))
    m = manifest.open(d)
    # a stored position moved by one (still sorted): the header stays consistent, the anchors do not
    arrays = {name: np.array(a) for name, a in m.arrays.items()}
    arrays["anchors"][0] += 1 if arrays["anchors"][1] > arrays["anchors"][0] + 1 else 0
    arrays["anchors"][-1] = 0
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "fingerprint", "format", "version")}
    manifest.write(tmp_path / "bad" / "epoch-0000", header, arrays)
    with pytest.raises(FormatError, match="anchors"):
        verify_epoch(tmp_path / "bad" / "epoch-0000")
    arrays = {name: np.array(a) for name, a in m.arrays.items()}
    for name, digest, says in (("dig", anchor_digest.DIGEST_PREFIX + "0" * 32, "regenerated from the seed"),
                               ("old", "v1:" + "0" * 32, "another version")):
        header["dflash"] = dict(header["dflash"], anchor_digest=digest)
        manifest.write(tmp_path / name / "epoch-0000", header, arrays)
        with pytest.raises(FormatError, match=f"anchor digest.*{says}"):
            verify_epoch(tmp_path / name / "epoch-0000")


def test_dflash_option_errors(dataset, planned, tmp_path):
    plan_path, src = planned
    with pytest.raises(ConfigError, match="--target-config"):
        drafter_options(max_anchors=8)
    with pytest.raises(ConfigError, match="varlen layout only"):
        _cfg(dataset, layout="padded")
    with pytest.raises(ConfigError, match="anchor-policy"):
        _cfg(dataset, anchor_policy="all")
    with pytest.raises(ConfigError, match="lengths file"):
        from dflash_prep.formats.lengths import read_lengths_file
        np.save(tmp_path / "l.npy", np.asarray(src.lengths))
        p = plan_mod.Plan(data=read_lengths_file(tmp_path / "l.npy").describe(), boundaries=(),
                          budget=plan_mod.Budget(value=T))
        pack_epochs(plan=p, epochs=[0], out=tmp_path / "x", config=_cfg(dataset), lengths=tmp_path / "l.npy")
    with pytest.raises(ConfigError, match="lacks"):
        DrafterCostModel.from_dims("hidden=4")


def test_cli_pack_dflash_then_verify(dataset, planned, tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    plan_path, _ = planned
    runner = CliRunner()
    res = runner.invoke(app, ["pack", str(dataset), "--plan", str(plan_path), "--out", str(tmp_path / "m"),
                              "--epochs", "0-1", "--world-size", "2", "--objective", "dflash", "--max-anchors", "32",
                              "--target-dims", "hidden=256,layers=8,intermediate=768,heads=4,kv_heads=2,head_dim=64,"
                              "vocab=1000", "--draft-layers", "3"])
    assert res.exit_code == 0, res.output
    h = manifest.open(tmp_path / "m" / "epoch-0001").header["dflash"]
    assert h["max_anchors"] == 32 and h["cost_model"]["draft_layers"] == 3 and h["anchor_digest"].startswith(anchor_digest.DIGEST_PREFIX)
    assert "anchor_fill" in res.output
    res = runner.invoke(app, ["verify", str(tmp_path / "m")])
    assert res.exit_code == 0 and "2 epoch(s) verified" in res.output, res.output
    res = runner.invoke(app, ["pack", str(dataset), "--plan", str(plan_path), "--out", str(tmp_path / "n"),
                              "--epoch", "0", "--objective", "dflash"])
    assert res.exit_code == 1 and "--target-config" in res.output


def test_analyze_dflash_predicts_the_pack(dataset, planned, tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    res = CliRunner().invoke(app, ["analyze", str(dataset), "--out", str(tmp_path), "--budget", str(T), "--json",
                                   "--no-plot", "--objective", "dflash", "--max-anchors", "24", "--target-config",
                                   str(dataset.parent / "target"), "--draft-layers", "2", "--buckets", "2"])
    assert res.exit_code == 0, res.output
    pred = json.loads(res.stdout)["dflash"]
    [d] = pack_epochs(plan=tmp_path / "plan.json", epochs=[0], out=tmp_path / "m",
                      config=PackConfig(world_size=8, objective="dflash", options=_cfg(dataset).options))
    s = manifest.open(d).summary
    assert pred["useful_anchor_slots"] == s["useful_anchor_slots"] == 1.0 and pred["anchors"] == s["anchors"]
    assert pred["token_fill"] == pytest.approx(s["token_fill"], abs=0.05)
    assert 0 < pred["anchor_cost_share"] < 1 and pred["rank_imbalance"] >= 0


def test_pack_config_flags_round_trip(dataset, planned, tmp_path):
    """The flags PackConfig.cli_flags prints (the trainer's message) rebuild the same config."""
    import shlex

    from typer.testing import CliRunner

    from dflash_prep.cli import app

    plan_path, _ = planned
    cfg = _cfg(dataset, anchor_policy="density", anchor_seed=3).resolve(plan_mod.load(plan_path))
    args = ["pack", str(dataset), "--plan", str(plan_path), "--out", str(tmp_path / "m"), "--epoch", "0"]
    res = CliRunner().invoke(app, args + shlex.split(cfg.cli_flags()))
    assert res.exit_code == 0, res.output
    assert load_pack_config(tmp_path / "m") == cfg
    # a sliding window in the cost model: --sliding-window round-trips through the printed flags
    cm = dataclasses.replace(cfg.options.cost_model, sliding_window=16)
    win = dataclasses.replace(cfg, options=dataclasses.replace(cfg.options, cost_model=cm))
    assert "--sliding-window 16" in win.cli_flags()
    res = CliRunner().invoke(app, args[:5] + [str(tmp_path / "w"), "--epoch", "0"] + shlex.split(win.cli_flags()))
    assert res.exit_code == 0, res.output
    assert load_pack_config(tmp_path / "w") == win


def test_drafter_cost_model_by_hand(tmp_path):
    from dflash_prep.objectives.drafter_cost import sample_cost

    (tmp_path / "config.json").write_text(json.dumps(QWEN_LIKE))
    cm = DrafterCostModel.from_config(tmp_path, draft_layers=2)
    assert cm == DrafterCostModel.from_dims("hidden=256,layers=8,intermediate=768,heads=4,kv_heads=2,head_dim=64,"
                                            "vocab=1000", draft_layers=2)
    H, h, kv, d, I, V, N, Lt, B = 256, 4, 2, 64, 768, 1000, 2, 8, 16
    layer = 2 * H * h * d + 2 * H * kv * d + 3 * H * I
    assert cm.target_params == Lt * layer and cm.draft_params == N * layer + N * H * H
    L, S, k = 300, 200, 7                       # expected anchor position L - S/2 - 1 = 199
    want = (2 * Lt * layer * L + 2 * h * d * Lt * L * L            # target forward + attention
            + 6 * (N * H * H + N * 2 * H * kv * d) * L               # fc + draft k/v over the context
            + 6 * N * layer * k * B + 12 * h * d * B * N * (k * 199 + k * B)   # blocks + prefix attention
            + 4 * k * (15 * 16 / 2 + 184 * 15) / 199 * H * V)   # frozen head, E[labelled rows] per block
    assert sample_cost(cm, B, [L], [S], [k])[0] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        (tmp_path / "config.json").write_text(json.dumps({k2: v for k2, v in QWEN_LIKE.items()
                                                           if k2 != "num_hidden_layers"}))
        DrafterCostModel.from_config(tmp_path)


def test_drafter_cost_model_with_a_sliding_window_by_hand():
    """Anchors uniform on [L - S, L - 2] = [100, 298]: E[min(a, W)] below, across and above the range."""
    from dflash_prep.objectives.drafter_cost import sample_cost

    dims = "hidden=256,layers=8,intermediate=768,heads=4,kv_heads=2,head_dim=64,vocab=1000"
    full = DrafterCostModel.from_dims(dims, draft_layers=2)
    h, d, N, B, L, S, k = 4, 64, 2, 16, 300, 200, 7
    base = sample_cost(full, B, [L], [S], [k])[0] - 12 * h * d * B * N * k * 199  # all but the prefix keys
    for W, seen in ((64, 64.0), (200, ((200 ** 2 - 100 ** 2) / 2 + 200 * 98) / 198), (298, 199.0), (4096, 199.0)):
        cm = DrafterCostModel.from_dims(dims, draft_layers=2, sliding_window=W)
        got = sample_cost(cm, B, [L], [S], [k])[0]
        assert got == pytest.approx(base + 12 * h * d * B * N * k * seen, rel=1e-12), W
        assert cm.describe(B)["sliding_window"] == W
    assert sample_cost(DrafterCostModel.from_dims(dims, 2, 64), B, [L], [S], [k])[0] < sample_cost(full, B, [L], [S], [k])[0]
    with pytest.raises(ConfigError, match="sliding-window"):
        DrafterCostModel.from_dims(dims, sliding_window=-1)


def test_dropped_samples_keep_their_digest_and_stored_anchors(dataset, planned, tmp_path):
    """drop_last leaves samples out of the epoch: anchors.npy holds the kept ones only, in
    sample_ids order, and the digest (over every sample of the dataset) still verifies."""
    plan_path, src = planned
    for ws in (3, 5, 7):                         # a world size that leaves a partial step to drop
        cfg = _cfg(dataset, store_anchors=True, drop_last=True, world_size=ws, max_anchors=16)
        [d] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / f"m{ws}", config=cfg)
        m = manifest.open(d)
        if len(m.arrays["dropped_ids"]):
            break
    assert len(m.arrays["dropped_ids"]) > 0
    full = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "f", config=_cfg(dataset, world_size=ws,
                                                                                    max_anchors=16))
    assert manifest.open(full[0]).header["dflash"]["anchor_digest"] == m.header["dflash"]["anchor_digest"]
    ds = open_dataset(dataset)
    k = np.asarray(m.arrays["anchor_counts"])
    off = np.concatenate([[0], np.cumsum(k)])
    pos = np.asarray(m.arrays["anchors"])
    assert len(pos) == off[-1]
    for j, i in enumerate(m.sample_ids):
        want = anchors.sample_anchors(ds.sample(int(i))[1], seed=5, epoch=0, sample_id=int(i), max_anchors=16)
        assert np.array_equal(pos[off[j]:off[j + 1]], want)
    verify_epoch(d)

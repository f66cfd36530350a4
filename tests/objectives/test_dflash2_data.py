"""pack / analyze / verify --objective dflash2: DFlash's machinery, DFlash2's options and step cost."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_prep import objectives
from dflash_prep.cli import app
from dflash_prep.errors import ConfigError
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.lengths import read_dataset_lengths, read_mask_counts
from dflash_prep.objectives import anchors, options
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.objectives.dflash2 import DFlash2Objective, DFlash2Options
from dflash_prep.objectives.drafter_cost import DFlash2CostModel, DrafterCostModel, mean_labelled, sample_cost
from dflash_prep.pack.config import load as load_pack_config
from dflash_prep.pack.pack import PackConfig, pack_epochs
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.verify import verify_epoch

from dflash_prep.tests.assets.fixtures import CHATS, write_jsonl

T = 8192
DIMS = "hidden=256,layers=8,intermediate=768,heads=4,kv_heads=2,head_dim=64,vocab=1000"
H, V = 256, 1000


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A byte-tokenized chat dataset (the fixture chats at varied lengths) and a plan for it."""
    tmp = tmp_path_factory.mktemp("dflash2")
    rng = np.random.default_rng(1)
    rows = [{"messages": [dict(m, content=m["content"] * int(rng.integers(1, 12))) for m in CHATS[i % len(CHATS)]]}
            for i in range(150)]
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(write_jsonl(tmp / "chat.jsonl", rows)),), out=tmp / "data",
                            chunk_rows=50))
    src = read_dataset_lengths(tmp / "data")
    path = plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=T), seed=5),
                         tmp / "plan")
    return tmp / "data", path


def _opts(cls=DFlash2Options, **kw):
    return options.from_flags(cls, options.PACK, {"target_dims": DIMS, "max_anchors": 24, "draft_layers": 2, **kw})


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_options_extend_dflash_with_the_released_defaults():
    o = DFlash2Options()
    assert isinstance(o, DrafterOptions) and o.cost_model is None
    sizes = (o.block_size, o.conv_kernel_size, o.conv_group_size, o.selector_rank, o.selector_top_k)
    assert sizes == (8, 2, 16, 256, 16)
    flags = {fl.name: fl for fl in options.flags(DFlash2Options, options.PACK)}
    assert flags["draft_layers"].default == 5 and flags["sliding_window"].default == 2048
    assert "released DFlash2 checkpoint" in flags["block_size"].help
    assert set(flags) - {fl.name for fl in options.flags(DrafterOptions, options.PACK)} == {
        "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"}
    built = _opts()
    assert built.cost_model.draft_layers == 2 and built.cost_model.sliding_window == 2048
    assert options.header(built) == {"block_size": 8, "max_anchors": 24, "anchor_policy": "cap", "anchor_seed": None,
                                     "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256,
                                     "selector_top_k": 16}
    line = options.to_flags(built)
    assert "--conv-group-size 16" in line and "--block-size 8" in line
    for bad, says in (({"conv_group_size": 48}, "must divide the target's hidden size 256"),
                      ({"selector_top_k": 2000}, "exceeds the target vocabulary 1000"),
                      ({"conv_kernel_size": 9}, "exceeds --block-size 8"), ({"selector_rank": 0}, "--selector-rank")):
        with pytest.raises(ConfigError, match=says):
            _opts(**bad)
    with pytest.raises(ConfigError, match="DFlash2Options"):
        PackConfig(objective="dflash2", options=_opts(DrafterOptions))


def test_cost_is_dflash_plus_exactly_the_conv_and_selector_terms():
    """Per sample, DFlash2's FLOPs minus DFlash's = k * conv + k * E[labelled rows] * selector (by hand)."""
    B, N, kc, gs, r, K = 8, 2, 2, 16, 256, 16
    base = DrafterCostModel.from_dims(DIMS, draft_layers=N, sliding_window=64)
    two = DFlash2CostModel.from_dims(DIMS, draft_layers=N, sliding_window=64, conv_kernel_size=kc,
                                     conv_group_size=gs, selector_rank=r, selector_top_k=K)
    G = H // gs
    conv = 24 * kc * H * (G + 1) * B * N           # (in + out conv) x (attention, MLP) x 3, per block token and layer
    selector = 6 * H * r + 3 * r * (2 * K + 1) + V + 2 * H * V  # P, A[p] * Ph, K dots, x3; top-K over V and its logits, forward only
    c1, c2 = base.coefficients(B), two.coefficients(B)
    assert c2["conv"] == conv and c2["selector"] == selector
    assert c2["anchors"] - c1["anchors"] == conv and c2["head_rows"] - c1["head_rows"] == selector
    assert {k: c2[k] for k in ("tokens", "tokens_sq", "anchor_pos")} == {k: c1[k] for k in ("tokens", "tokens_sq",
                                                                                              "anchor_pos")}
    L, S, k = np.array([300, 40, 7]), np.array([200, 10, 3]), np.array([7, 5, 1])
    rows = np.array([mean_labelled(float(s), float(B)) for s in S])
    want = k * conv + k * rows * selector
    got = sample_cost(two, B, L, S, k) - sample_cost(base, B, L, S, k)
    np.testing.assert_allclose(got, want, rtol=1e-9)
    assert (got > 0).all()


def test_pack_dflash2_deterministic_verified_and_costlier_than_dflash(planned, tmp_path):
    data, plan_path = planned
    cfg = PackConfig(objective="dflash2", options=_opts(), world_size=4)
    dirs = pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "a", config=cfg)
    pack_epochs(plan=plan_path, epochs=[0, 1], out=tmp_path / "b", config=cfg)
    assert _files(tmp_path / "a") == _files(tmp_path / "b"), "two packs differ"
    lens = np.asarray(read_dataset_lengths(data).lengths, np.int64)
    obj = objectives.get("dflash2")
    assert isinstance(obj, DFlash2Objective)
    for d in dirs:
        m = manifest.open(d)
        h = m.header["dflash"]                       # the family's section: DFlash's readers work unchanged
        assert m.header["options"]["objective"] == "dflash2" and m.layout == "varlen"
        assert (h["block_size"], h["conv_kernel_size"], h["selector_rank"]) == (8, 2, 256)
        assert h["cost_model"]["conv_group_size"] == 16 and "selector" in h["cost_model"]["coefficients"]
        assert np.array_equal(np.sort(m.sample_ids), np.arange(len(lens)))
        assert m.table[:, manifest.COL["real_tokens"]].max() <= T
        got = verify_epoch(d)
        assert got["rank_imbalance"] == pytest.approx(m.summary["rank_imbalance"], abs=1e-12)
        # verify prices the micro-batches with DFlash2's recorded cost model, not DFlash's
        seg = np.argsort(m.table[:, manifest.COL["start"]], kind="stable")     # file order, as verify reads it
        order = np.asarray(m.sample_ids)
        offsets = np.concatenate([[0], np.cumsum(m.table[seg, manifest.COL["count"]])]).astype(np.int64)
        mc = read_mask_counts(data)
        k = anchors.anchor_counts(mc.anchor_candidates, mc.supervised, 24, "cap", 8)
        cost = obj.verify_rank_cost(m, lens, order, offsets, mc.supervised)
        two = DFlash2CostModel.from_dims(DIMS, draft_layers=2, sliding_window=2048)
        want = np.add.reduceat(sample_cost(two, 8, lens[order], mc.supervised[order], k[order]), offsets[:-1])
        np.testing.assert_allclose(cost, want, rtol=1e-12)
        dflash_only = np.add.reduceat(sample_cost(DrafterCostModel(**{f: getattr(two, f) for f in
                                                                      DrafterCostModel.__dataclass_fields__}),
                                                  8, lens[order], mc.supervised[order], k[order]), offsets[:-1])
        assert (cost > dflash_only).all()
    # the same anchors as dflash with the same anchor options; the cost budget grows with the cost
    [d1] = pack_epochs(plan=plan_path, epochs=[0], out=tmp_path / "dflash",
                       config=PackConfig(objective="dflash", options=_opts(DrafterOptions, block_size=8,
                                                                           sliding_window=2048), world_size=4))
    h1, h2 = manifest.open(d1).header["dflash"], manifest.open(dirs[0]).header["dflash"]
    assert h1["anchor_digest"] == h2["anchor_digest"] and h2["cost_budget"] > h1["cost_budget"]
    assert load_pack_config(tmp_path / "a") == cfg.resolve(plan_mod.load(plan_path))


def test_cli_pack_dflash2_defaults_flags_and_round_trip(planned, tmp_path):
    data, plan_path = planned
    runner = CliRunner()
    base = ["pack", str(data), "--plan", str(plan_path), "--epoch", "0", "--target-dims", DIMS]
    res = runner.invoke(app, base + ["--out", str(tmp_path / "m"), "--objective", "dflash2", "--max-anchors", "24"])
    assert res.exit_code == 0, res.output
    h = manifest.open(tmp_path / "m" / "epoch-0000").header["dflash"]
    assert h["block_size"] == 8 and h["cost_model"]["draft_layers"] == 5 and h["cost_model"]["sliding_window"] == 2048
    res = runner.invoke(app, ["verify", str(tmp_path / "m")])
    assert res.exit_code == 0 and "1 epoch(s) verified" in res.output, res.output
    # the parent's default given explicitly is honoured (a flag given is never a default)
    res = runner.invoke(app, base + ["--out", str(tmp_path / "b16"), "--objective", "dflash2", "--block-size", "16",
                                     "--conv-kernel-size", "3"])
    assert res.exit_code == 0, res.output
    h = manifest.open(tmp_path / "b16" / "epoch-0000").header["dflash"]
    assert h["block_size"] == 16 and h["conv_kernel_size"] == 3
    # a dflash2 flag under --objective dflash is refused, not dropped
    res = runner.invoke(app, base + ["--out", str(tmp_path / "x"), "--objective", "dflash", "--conv-kernel-size", "3"])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())
    assert "--conv-kernel-size is an option of --objective dflash2" in text and "--objective dflash;" in text, text
    assert not (tmp_path / "x").exists()
    # the flags a config prints rebuild it
    cfg = PackConfig(objective="dflash2", options=_opts(selector_top_k=8, anchor_seed=3)).resolve(
        plan_mod.load(plan_path))
    res = runner.invoke(app, ["pack", str(data), "--plan", str(plan_path), "--out", str(tmp_path / "rt"), "--epoch",
                              "0"] + shlex.split(cfg.cli_flags()))
    assert res.exit_code == 0, res.output
    assert load_pack_config(tmp_path / "rt") == cfg


@pytest.mark.parametrize("command", ["pack", "analyze"])
def test_shared_flags_show_once_in_help(command):
    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--block-size", "--target-dims", "--target-config", "--draft-layers", "--max-anchors"):
        assert len([w for w in out.split() if w == flag]) == 1, (flag, out)
    assert "--conv-kernel-size" in out and "(--objective dflash2: 8)" in out
    assert "Objective dflash2" in out


def test_analyze_dflash2_predicts_the_pack(planned, tmp_path):
    data, _ = planned
    res = CliRunner().invoke(app, ["analyze", str(data), "--out", str(tmp_path), "--budget", str(T), "--json",
                                   "--no-plot", "--objective", "dflash2", "--max-anchors", "24", "--target-dims", DIMS,
                                   "--draft-layers", "2", "--buckets", "2"])
    assert res.exit_code == 0, res.output
    pred = json.loads(res.stdout)["dflash2"]
    [d] = pack_epochs(plan=tmp_path / "plan.json", epochs=[0], out=tmp_path / "m",
                      config=PackConfig(world_size=1, objective="dflash2", options=_opts()))   # no splits
    s = manifest.open(d).summary
    assert pred["anchors"] == s["anchors"] and pred["useful_anchor_slots"] == 1.0
    assert pred["token_fill"] == pytest.approx(s["token_fill"], abs=0.05)
    dflash = json.loads(CliRunner().invoke(app, [
        "analyze", str(data), "--out", str(tmp_path / "d1"), "--budget", str(T), "--json", "--no-plot", "--objective",
        "dflash", "--max-anchors", "24", "--target-dims", DIMS, "--draft-layers", "2", "--block-size", "8",
        "--buckets", "2"]).stdout)["dflash"]
    assert pred["anchors"] == dflash["anchors"] and pred["anchor_cost_share"] > dflash["anchor_cost_share"]

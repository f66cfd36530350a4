"""bench.drafter_gpu: the --smoke run (CPU, tiny Qwen3) and the padded recipe batch it times."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_prep.formats.fileio import check_header

from dflash_prep.bench import drafter_gpu as g


@pytest.fixture
def keep_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def test_smoke_run_writes_both_paths_and_their_ratio(tmp_path, keep_determinism):
    assert g.main(["--smoke", "--out", str(tmp_path)]) == 0
    rep = check_header(json.loads((tmp_path / "drafter_gpu.json").read_text()), path=tmp_path / "drafter_gpu.json",
                       format=g.BENCH_FORMAT, versions=(1,))
    ours, padded = rep["rows"]
    assert ours["path"].startswith("ours") and padded["path"].startswith("padded")
    for r in (ours, padded):
        assert r["timed_steps"] == g.SMOKE["steps"] and r["time_s"] > 0
        assert r["anchors"] > 0 and r["target_tokens"] > 0 and r["anchors_per_s"] > 0 and r["tokens_per_s"] > 0
        assert r["anchors_per_s"] == pytest.approx(r["anchors"] / r["time_s"])
        assert r["computed_anchors"] >= r["anchors"] and r["computed_tokens"] >= r["target_tokens"]
        assert r["model_flops"] > 0 and r["mfu"] is None  # no peak on CPU
    assert ours["useful_anchor_slots"] == 1.0 and ours["useful_tokens"] == 1.0  # packed: nothing wasted
    assert padded["useful_anchor_slots"] < 1.0 and padded["useful_tokens"] < 1.0
    assert rep["ratio_anchors_per_s"] == pytest.approx(ours["anchors_per_s"] / padded["anchors_per_s"])
    assert rep["smoke"] is True and rep["target_met"] is None  # CPU figures give no verdict on the GPU target
    md = (tmp_path / "drafter_gpu.md").read_text()
    assert "ours / padded anchors/s" in md and "smoke: CPU figures, no verdict" in md
    assert ": met" not in md and "NOT met" not in md


def test_padded_batch_keeps_the_real_blocks_and_pads_rows_to_the_recipe_shape():
    from dflash_prep.objectives.anchors import anchor_counts
    from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids
    from dflash_prep.train.objectives.dflash.objective import DFlashObjective
    from dflash_prep.train.objectives.dflash.batch import AnchorSpec

    cfg = g.GpuBenchConfig(**{**g.SMOKE, "n": 40})
    lens, mc = g.inputs(cfg)
    k = anchor_counts(mc.anchor_candidates, mc.supervised, g.MAX_ANCHORS)
    taps = build_target_layer_ids(cfg.layers, 1)
    target, hc = g.build_target(cfg, torch.device("cpu"), taps)
    d = Drafter(DrafterConfig.from_target_config(hc, 1, g.B, cfg.vocab - 1, target_layer_ids=taps))
    obj = DFlashObjective(d, target, g.objective_config("cpu"), anchor_spec=AnchorSpec(0, g.MAX_ANCHORS, "cap", g.B), gamma=7.0,
                          identity={})
    ds = g.SyntheticMasks(lens, mc.supervised, cfg.vocab, 0)
    sids = np.array([3, 7])
    pb, real, na = g.padded_batch(obj, ds, sids, k, 0, np.random.default_rng(0))
    Lmax, kpad = int(lens[sids].max()), int(min(g.MAX_ANCHORS, k[sids].max()))
    assert real == int(lens[sids].sum()) and na == int(k[sids].sum())
    assert pb.real_tokens == 2 * Lmax and pb.cu_seqlens.tolist() == [0, Lmax, 2 * Lmax]
    assert pb.n_anchors == 2 * kpad and pb.cu_blk.tolist() == [0, kpad * g.B, 2 * kpad * g.B]
    assert float(pb.weights.double().sum()) == pytest.approx(pb.weight_sum)        # fillers weigh 0
    assert int((pb.weights.view(-1, g.B)[:, 1:] > 0).any(1).sum()) <= na
    for j in range(2):                                                              # sorted within each row
        a = pb.anchors[j * kpad:(j + 1) * kpad]
        assert torch.all(a[1:] >= a[:-1]) and int(a.max()) < Lmax
    loss, stats = obj.loss(pb, lambda: torch.autocast("cpu", enabled=False))
    assert torch.isfinite(loss) and stats[1] == 2 * kpad

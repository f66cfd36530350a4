"""bench/convergence: a tiny end-to-end smoke (synth -> BPE -> tokenize -> plans -> pack ->
train -> validate) that checks the report, the determinism of a run and bad options."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from dflash_prep.errors import ConfigError  # noqa: E402
from dflash_prep.formats.fileio import read_json  # noqa: E402

from dflash_prep.bench import convergence as conv  # noqa: E402


def test_config_rejects_bad_options():
    with pytest.raises(ConfigError, match="unknown strategies"):
        conv.ConvConfig(strategies=("sorted",))
    with pytest.raises(ConfigError, match="exceeds the budget"):
        conv.ConvConfig(max_len=4096, budget=2048)
    with pytest.raises(ConfigError):
        conv.ConvConfig(steps=0)


def test_convergence_smoke(tmp_path):
    cfg = conv.ConvConfig(work=tmp_path, n_train=160, n_val=6, vocab=384, max_len=512, budget=1024, grad_accum=2,
                          steps=2, eval_every=1, window=8, seeds=(0,), strategies=("bucketed", "random"))
    body = conv.run(cfg)
    back = read_json(tmp_path / "convergence.json", format=conv.CONV_FORMAT, versions=(conv.CONV_VERSION,))
    assert (tmp_path / "convergence.png").stat().st_size > 10_000
    assert len(back["runs"]) == 2
    for r in body["runs"]:
        ev = r["evals"]
        assert [e["step"] for e in ev] == [0, 1, 2]
        losses = [e["val_loss"] for e in ev[1:]]
        # a freshly initialised model scores about ln(vocab); training steps keep it finite and near
        assert all(math.isfinite(x) and 0.5 * math.log(384) < x < 1.5 * math.log(384) for x in losses)
        assert ev[1]["time_s"] > 0 and ev[2]["time_s"] > ev[1]["time_s"]
        assert ev[2]["real_tokens"] > ev[1]["real_tokens"] > 0
    s = body["summary"]["strategies"]
    assert set(s) == {"bucketed", "random"}
    assert s["bucketed"]["pack"]["efficiency"] > s["random"]["pack"]["efficiency"]
    assert s["random"]["welch_t_vs_random"] is None
    # a run is a pure function of (strategy, seed, data): repeating one gives the same losses
    data, val = conv.build_data(cfg)
    again = conv.run_one("random", 0, data, conv.Validator(val, tmp_path, cfg.budget), cfg)
    first = next(r for r in body["runs"] if r["strategy"] == "random")
    assert [e["val_loss"] for e in again["evals"]] == [e["val_loss"] for e in first["evals"]]

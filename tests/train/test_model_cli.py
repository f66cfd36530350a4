"""Model on the Triton interpreter, config files and flags, the benchmark's smoke mode."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train import bench
from dflash_prep.train.config import ModelConfig, build, preset
build_config = build
from dflash_prep.train.data import build_batch
from dflash_prep.train.objectives.lm.model import Decoder, token_loss_sum

from dflash_prep.tests.train.train_fakes import FakeDataset


def test_presets_shapes_and_100m_size():
    assert preset("tiny").head_dim == 64  # the Triton kernels need 32/64/128
    m = ModelConfig(**{**preset("100m").__dict__, "vocab_size": 32000})
    per_layer = (m.d_model * m.n_heads * m.head_dim * 2 + m.d_model * m.n_kv_heads * m.head_dim * 2
                 + 3 * m.d_model * m.ffn_dim + 2 * m.d_model)
    total = m.n_layers * per_layer + m.vocab_size * m.d_model + m.d_model
    assert 90e6 < total < 110e6, total  # ~100M with a 32K vocabulary and tied embeddings
    tiny = Decoder(preset("tiny", vocab_size=259))
    t = preset("tiny")
    want = t.n_layers * (t.d_model * t.n_heads * t.head_dim * 2 + t.d_model * t.n_kv_heads * t.head_dim * 2
                         + 3 * t.d_model * t.ffn_dim + 2 * t.d_model) + 259 * t.d_model + t.d_model
    assert tiny.num_parameters() == want  # the formula above counts what the model builds


@pytest.mark.parametrize("bad", [dict(n_heads=3), dict(n_kv_heads=3), dict(head_dim=63, d_model=126, n_heads=2)])
def test_bad_model_shapes_are_config_errors(bad):
    with pytest.raises(ConfigError):
        preset("tiny", **bad)


def test_config_file_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('epochs = 3\nlr = 0.001\n[model]\npreset = "tiny"\nn_layers = 1\n')
    cfg = build(f, lr=0.01, max_steps=None)
    assert (cfg.epochs, cfg.lr, cfg.model_overrides) == (3, 0.01, {"n_layers": 1})
    assert cfg.model_config(259).n_layers == 1 and cfg.model_config(259).vocab_size == 259
    f.write_text("epoch = 3\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        build(f)
    with pytest.raises(ConfigError, match="--attn"):
        build_config(attn="flash")
    with pytest.raises(ConfigError, match="unknown keys"):       # --resume/--from-scratch is one choice now
        f.write_text("resume = false\n") and build(f)


def test_shipped_config_files_parse():
    from pathlib import Path

    files = sorted((Path(__file__).parents[2] / "train" / "configs").glob("*.toml"))
    assert files
    for f in files:
        cfg = build(f)
        assert cfg.model_config(32000).vocab_size == 32000


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_triton_interpreter_matches_reference_in_the_model(layout):
    """--attn triton on CPU runs the interpreter; the loss and gradients match the reference path."""
    from dflash_prep.kernels.attention import force_backend

    cfg = ModelConfig(vocab_size=97, n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=64)
    ds = FakeDataset(n=3, lo=5, hi=12, seed=3)
    mb = type("MB", (), dict(step=0, rank=0, accum=0, sample_ids=[0, 1, 2], max_len=int(ds.lengths[:3].max())))()
    b = build_batch(ds, mb, layout)
    out = {}
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        model = Decoder(cfg)
        with force_backend(backend):
            loss = token_loss_sum(model(b.input_ids, **b.model_inputs()), b.labels)
        loss.backward()
        out[backend] = (loss.detach(), model.blocks[0].attn.q.weight.grad.clone())
    torch.testing.assert_close(out["triton"][0], out["reference"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["reference"][1], rtol=1e-3, atol=1e-5)


def test_bench_gpu_smoke_mode_runs_every_strategy_on_cpu(tmp_path):
    out = tmp_path / "dflash_prep.bench.json"
    assert bench.main(["--gpu", "--smoke", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["format"] == bench.BENCH_FORMAT
    rows = {r["strategy"]: r for r in rep["rows"]}
    assert set(rows) == set(bench.STRATEGIES)
    assert rows["varlen"]["layout"] == "varlen" and rows["varlen"]["timed_efficiency"] == 1.0
    # the packed epochs differ the way definitions.md says: sorted and varlen fill best, random worst
    eff = {k: r["epoch_efficiency"] for k, r in rows.items()}
    assert eff["full-random"] < eff["bucketed-k6"] < eff["sorted-static"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and 0 <= r["data_wait_share"] < 1

"""The DFlash trainer on CUDA (bf16 target, Triton attention_dflash and varlen); skipped without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_prep.kernels.attention import force_backend
from dflash_prep.train.loop import train

from dflash_prep.tests.train.dflash_fixtures import MASK_ID, dflash_cfg
from dflash_prep.tests.train.train_fakes import FakeSource

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def target32(tmp_path_factory):
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    spec = TargetSpec(vocab_size=300, hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=256)
    return build_target(tmp_path_factory.mktemp("t32") / "target", spec, texts=default_texts(20_000))


def test_cuda_dflash_training_runs_and_reports_mfu(tmp_path, target32):
    s = train(dflash_cfg(tmp_path, target32, device="cuda", max_steps=6, block_size=8, max_anchors=16),
              source=FakeSource(n=96, layout="varlen", budget=256))
    assert s["device"].startswith("cuda") and s["steps"] == 6
    assert math.isfinite(s["loss_first"]) and math.isfinite(s["loss_last"]) and s["tau_last"] >= 1.0
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()[1:]]
    name = torch.cuda.get_device_name()
    if any(k in name for k in ("H100", "H200", "A100")):
        assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in recs)


def test_cuda_triton_loss_matches_reference(target32):
    from dflash_prep.train.data import iter_steps
    from dflash_prep.train.objectives import build_objective

    src = FakeSource(n=48, layout="varlen", budget=256)
    cfg = dflash_cfg("unused", target32, device="cuda", block_size=8, max_anchors=16)
    obj = build_objective(cfg, src.dataset, torch.device("cuda"))
    m = src.manifest(0)
    sb = next(iter(iter_steps(src.dataset, m, 0, build=lambda mb: obj.build(src.dataset, mb, 0, m.layout, False))))
    b = sb.micro[0].to(torch.device("cuda"))
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    losses = {}
    for backend in ("triton", "reference"):
        with force_backend(backend), torch.no_grad():
            losses[backend] = float(obj.loss(b, autocast)[0])
    assert losses["triton"] == pytest.approx(losses["reference"], rel=2e-2), losses
    assert MASK_ID not in b.input_ids.tolist()

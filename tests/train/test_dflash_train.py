"""The DFlash trainer end to end on the fakes and a tiny real target: the step normaliser over
ranks and accumulation, bitwise resume, the run contract, and the LM objective on a transformers model."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.errors import ConfigError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.config import TrainConfig
from dflash_prep.train.distributed import Dist
from dflash_prep.train.loop import train, train_step

from tests.train.dflash_fixtures import dflash_cfg, dflash_grads_setup, gloo_dflash_worker, tiny_target
from tests.train.train_fakes import FakeSource


def _src(**kw):
    return FakeSource(n=48, layout="varlen", **kw)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_sum_w_over_two_ranks_equals_one_rank_two_accum(tmp_path):
    """2 gloo ranks x A=1 == 1 rank x A=2 over the same micro-batches: sum w is all-reduced first."""
    target = str(tiny_target())
    mp.spawn(gloo_dflash_worker, args=(2, str(tmp_path / "init"), str(tmp_path), target), nprocs=2, join=True)
    got = torch.load(tmp_path / "dflash_grads.pt", weights_only=False)
    obj, opt, sb = dflash_grads_setup(target, 1, 2, 0)
    assert len(sb.micro) == 2
    ws = [b.weight_sum for b in sb.micro]
    assert abs(ws[0] - ws[1]) > 1e-3, "the test needs micro-batches with different weight sums"
    st = train_step(obj.model, opt, sb, lr=1e-3, grad_clip=0.0, d=Dist(0, 1, 0, torch.device("cpu")),
                    autocast=contextlib.nullcontext, objective=obj)
    want = {n: p.grad for n, p in obj.model.named_parameters()}
    for n, g in want.items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert got["step"]["loss"] == pytest.approx(st["loss"], rel=1e-6)
    assert got["step"]["tau"] == pytest.approx(st["tau"]) and got["step"]["anchors"] == st["anchors"]
    # sensitivity: a mean of per-micro-batch means gives a visibly different gradient
    obj2, _, _ = dflash_grads_setup(target, 1, 2, 0)
    for b in sb.micro:
        loss, _ = obj2.loss(b, contextlib.nullcontext)
        (loss / b.weight_sum / 2).backward()
    wrong = dict(obj2.model.named_parameters())["fc.weight"].grad
    assert not torch.allclose(wrong, want["fc.weight"], rtol=1e-3, atol=1e-6)


def _params(out):
    return ckpt.load(out / ckpt.CKPT_FILE)["model"]


def test_resume_is_bitwise_and_metrics_are_logged(tmp_path):
    target = tiny_target()
    n, k = 5, 2
    a = train(dflash_cfg(tmp_path / "a", target, max_steps=n), source=_src(grad_accum=2))
    train(dflash_cfg(tmp_path / "b", target, max_steps=k), source=_src(grad_accum=2))
    b = train(dflash_cfg(tmp_path / "b", target, max_steps=n), source=_src(grad_accum=2))
    assert a["global_step"] == b["global_step"] == n and b["steps"] == n - k
    pa, pb = _params(tmp_path / "a"), _params(tmp_path / "b")
    assert set(pa) == set(dict(torch.load(tmp_path / "a" / ckpt.CKPT_FILE, weights_only=True)["model"]))
    assert "fc.weight" in pa and "layers.1.self_attn.k_norm.weight" in pa
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"{name}: max diff {(pa[name] - pb[name]).abs().max().item()}"
    recs = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()[1:]]
    assert len(recs) == n
    for r in recs:
        assert r["anchors"] > 0 and 1.0 <= r["tau"] <= 4.0 and len(r["slot_acc"]) == 3
        assert r["anchors_per_s"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] is None  # CPU: no MFU
    assert a["tau_last"] >= 1.0 and a["anchors"] == sum(r["anchors"] for r in recs)
    contract = ckpt.load(tmp_path / "a" / ckpt.CKPT_FILE)["run_key"]["contract"]
    for key in ("target_fingerprint", "tokenizer_hash", "chat_template_hash", "target_layer_ids", "mask_token_id",
                "block_size", "gamma", "anchors"):
        assert contract[key] is not None, key
    assert contract["anchors"]["policy"] == "cap" and contract["block_size"] == 4


@pytest.mark.parametrize("change,field", [
    (dict(block_size=3), "contract.block_size"),
    (dict(gamma=2.5), "contract.gamma"),
    (dict(max_anchors=4), "contract.anchors.max_anchors"),
    (dict(mask_token_id=2), "contract.mask_token_id"),
    (dict(target_seed=1), "contract.target_fingerprint"),
])
def test_contract_change_is_refused_naming_the_field(tmp_path, change, field):
    target = tiny_target()
    train(dflash_cfg(tmp_path, target, max_steps=1), source=_src())
    change = dict(change)
    new_target = tiny_target(change.pop("target_seed")) if "target_seed" in change else target
    with pytest.raises(ckpt.PlanChanged, match=field.replace(".", r"\.")):
        train(dflash_cfg(tmp_path, new_target, max_steps=2, **change), source=_src())
    s = train(dflash_cfg(tmp_path, new_target, max_steps=1, from_scratch=True, **change), source=_src())
    assert s["global_step"] == 1


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="--target"):
        TrainConfig(objective="dflash")
    with pytest.raises(ConfigError, match="objective dflash"):
        TrainConfig(target="somewhere")
    with pytest.raises(ConfigError, match="block-size"):
        dflash_cfg("x", "t", block_size=1)


def test_lm_objective_on_a_transformers_model_saves_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_target()
    cfg = TrainConfig(out=str(tmp_path), init_from=str(target), max_steps=4, warmup_steps=1, lr=1e-2,
                      progress=False, prefetch=2, device="cpu", ce_chunk=32)
    s = train(cfg, source=FakeSource(n=48))  # padded manifest: packed for the transformers model
    assert s["steps"] == 4 and s["loss_first"] > 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    before = AutoModelForCausalLM.from_pretrained(target)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template
    w0, w1 = before.get_input_embeddings().weight, hf.get_input_embeddings().weight
    assert not torch.equal(w0, w1), "training did not change the saved weights"
    state = ckpt.load(tmp_path / ckpt.CKPT_FILE)
    for name, t in hf.state_dict().items():
        assert torch.equal(state["model"][name], t), name
    assert state["run_key"]["contract"]["objective"] == "lm" and state["run_key"]["contract"]["init_from"]

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
from dflash_prep.train.config import build as build_config
from dflash_prep.train.distributed import Dist
from dflash_prep.train.loop import train, train_step

from dflash_prep.tests.train.dflash_fixtures import (assert_same_update, dflash_cfg, dflash_grads_setup, gloo_dflash_worker,
                                                      tiny_target)
from dflash_prep.tests.train.train_fakes import FakeSource


def _src(**kw):
    return FakeSource(n=48, layout="varlen", **kw)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("recipe", [dict(), dict(slot_weights="dpace", optimizer="muon")], ids=["decay", "dpace"])
def test_sum_w_over_two_ranks_equals_one_rank_two_accum(tmp_path, recipe):
    """2 gloo ranks x A=1 == 1 rank x A=2 over the same micro-batches (uneven anchor counts): sum w
    is all-reduced over the step, before any backward (decay) or after the forward (D-PACE, whose
    weights come out of it); the gradient and the update (AdamW / Muon) agree."""
    target = str(tiny_target())
    mp.spawn(gloo_dflash_worker, args=(2, str(tmp_path / "init"), str(tmp_path), target, recipe), nprocs=2, join=True)
    got = torch.load(tmp_path / "dflash_grads.pt", weights_only=False)
    obj, opt, sb = dflash_grads_setup(target, 1, 2, 0, **recipe)
    assert obj.deferred_denominator == (recipe.get("slot_weights") == "dpace")
    assert len(sb.micro) == 2
    assert sb.micro[0].n_anchors != sb.micro[1].n_anchors, "the test needs uneven anchor counts"
    ws = [b.weight_sum for b in sb.micro]
    assert abs(ws[0] - ws[1]) > 1e-3, "the test needs micro-batches with different weight sums"
    init = {n: p.detach().clone() for n, p in obj.model.named_parameters()}
    st = train_step(obj.model, opt, sb, lr=1e-3, grad_clip=0.0, d=Dist(0, 1, 0, torch.device("cpu")),
                    autocast=contextlib.nullcontext, objective=obj)
    want = {n: p.grad for n, p in obj.model.named_parameters()}
    for n, g in want.items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert_same_update(got["params"], init, obj.model, opt)
    assert got["step"]["loss"] == pytest.approx(st["loss"], rel=1e-6)
    assert got["step"]["targets"] == pytest.approx(st["targets"], rel=1e-9)
    assert got["step"]["tau"] == pytest.approx(st["tau"]) and got["step"]["anchors"] == st["anchors"]
    # sensitivity: a rank-local normaliser (a mean of per-micro-batch means) gives a visibly different gradient
    obj2, _, _ = dflash_grads_setup(target, 1, 2, 0, **recipe)
    for b in sb.micro:
        loss, stats = obj2.loss(b, contextlib.nullcontext)
        (loss / float(stats[-1]) / 2).backward()
    wrong = dict(obj2.model.named_parameters())["fc.weight"].grad
    assert not torch.allclose(wrong, want["fc.weight"], rtol=1e-3, atol=1e-6)


def _params(out):
    return ckpt.load(out / ckpt.CKPT_FILE)["model"]


RECIPE = dict(slot_weights="dpace", optimizer="muon", loss="kl", kl_temperature=2.0)


@pytest.mark.parametrize("recipe", [dict(), RECIPE], ids=["decay-adamw-ce", "dpace-muon-kl"])
def test_resume_is_bitwise_and_metrics_are_logged(tmp_path, capsys, recipe):
    target = tiny_target()
    n, k = 5, 2
    a = train(dflash_cfg(tmp_path / "a", target, max_steps=n, **recipe), source=_src(grad_accum=2))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dflash recipe:"))
    want = "slot weights dpace alpha=0.5, loss kl T=2, optimizer muon lr=0.03 + adamw lr=0.003" if recipe \
        else "slot weights decay gamma=1, loss ce, optimizer adamw lr=0.003"
    assert "B=4, 2 draft layer(s), full attention, " + want in line, line
    train(dflash_cfg(tmp_path / "b", target, max_steps=k, **recipe), source=_src(grad_accum=2))
    b = train(dflash_cfg(tmp_path / "b", target, max_steps=n, **recipe), source=_src(grad_accum=2))
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
    keys = ("dpace_alpha", "kl_temperature") if recipe else ("gamma",)
    for key in ("target_fingerprint", "tokenizer_hash", "chat_template_hash", "target_layer_ids", "mask_token_id",
                "block_size", "anchors", "slot_weights", "loss", "optimizer") + keys:
        assert contract[key] is not None, key
    assert contract["anchors"]["policy"] == "cap" and contract["block_size"] == 4
    assert (contract["slot_weights"], contract["loss"], contract["optimizer"]) == \
        (("dpace", "kl", "muon") if recipe else ("decay", "ce", "adamw"))


@pytest.mark.parametrize("change,field", [
    (dict(block_size=3), "contract.block_size"),
    (dict(gamma=2.5), "contract.gamma"),
    (dict(max_anchors=4), "contract.anchors.max_anchors"),
    (dict(mask_token_id=2), "contract.mask_token_id"),
    (dict(target_seed=1), "contract.target_fingerprint"),
    (dict(slot_weights="dpace"), "contract.slot_weights"),
    (dict(loss="kl"), "contract.loss"),
    (dict(optimizer="muon"), "contract.optimizer"),
    (dict(base=RECIPE, dpace_alpha=0.3), "contract.dpace_alpha"),
    (dict(base=RECIPE, kl_temperature=1.0), "contract.kl_temperature"),
])
def test_contract_change_is_refused_naming_the_field(tmp_path, change, field):
    target = tiny_target()
    change = dict(change)
    base = change.pop("base", {})
    change = {**base, **change}
    train(dflash_cfg(tmp_path, target, max_steps=1, **base), source=_src())
    new_target = tiny_target(change.pop("target_seed")) if "target_seed" in change else target
    with pytest.raises(ckpt.PlanChanged, match=field.replace(".", r"\.")):
        train(dflash_cfg(tmp_path, new_target, max_steps=2, **change), source=_src())
    s = train(dflash_cfg(tmp_path, new_target, max_steps=1, from_scratch=True, **change), source=_src())
    assert s["global_step"] == 1


def test_dflash_defaults_follow_the_recipe(tmp_path):
    from dflash_prep.train.config import build

    toml = tmp_path / "run.toml"
    toml.write_text('objective = "dflash"\ntarget = "t"\nslot_weights = "decay"\ngamma = 3.0\nloss = "kl"\n'
                    'kl_temperature = 2.0\noptimizer = "adamw"\n')
    f = build(toml, optimizer="muon", muon_lr=0.01)  # file keys, then flags
    o = f.options
    assert (o.slot_weights, o.gamma, o.loss, o.kl_temperature, f.optimizer, f.muon_lr) == \
        ("decay", 3.0, "kl", 2.0, "muon", 0.01)
    c = build_config(objective="dflash", target="t")
    o = c.options
    assert (o.slot_weights, o.dpace_alpha, o.loss, c.optimizer, o.draft_layers, o.sliding_window) == \
        ("dpace", 0.5, "ce", "muon", 5, 2048)
    assert build_config(objective="dflash", target="t", sliding_window=0).options.sliding_window == 0  # 0 = full
    lm = build_config()
    assert (type(lm.options).__name__, lm.optimizer) == ("LMTrainOptions", "adamw")
    assert build_config(objective="dflash", target="t", slot_weights="decay", optimizer="adamw").optimizer == "adamw"
    for bad, match in ((dict(loss="kl"), "objective dflash"), (dict(slot_weights="dpace"), "objective dflash"),
                       (dict(optimizer="sgd"), "--optimizer"), (dict(objective="dflash", target="t", loss="mse"), "--loss"),
                       (dict(objective="dflash", target="t", dpace_alpha=0.0), "--dpace-alpha"),
                       (dict(objective="dflash", target="t", kl_temperature=0.0), "--kl-temperature"),
                       (dict(objective="dflash", target="t", gamma=0.0), "--gamma"),
                       (dict(objective="dflash", target="t", mask_token_id=-2), "--mask-token-id"),
                       (dict(objective="dflash", target="t", init_from="x"), "--init-from is an option of "
                        "--objective lm")):
        with pytest.raises(ConfigError, match=match):
            build_config(**bad)


def test_bad_options_are_refused():
    with pytest.raises(ConfigError, match="--target"):
        build_config(objective="dflash")
    with pytest.raises(ConfigError, match="objective dflash"):
        build_config(target="somewhere")
    with pytest.raises(ConfigError, match="block-size"):
        dflash_cfg("x", "t", block_size=1)


def test_lm_objective_on_a_transformers_model_saves_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_target()
    cfg = build_config(out=str(tmp_path), init_from=str(target), max_steps=4, warmup_steps=1, lr=1e-2,
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

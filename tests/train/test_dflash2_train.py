"""The DFlash2 trainer on the fakes and a tiny real target: DFlash's guarantees hold for the
variant (the step normaliser over ranks and accumulation with the selector term, bitwise resume),
the identity-initialised drafter is DFlash's, the warm start proposes the DFlash drafter's
tokens, the metrics are logged, and a manifest packed for other sizes is refused."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.errors import ConfigError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.distributed import Dist
from dflash_prep.train.loop import train, train_step

from dflash_prep.tests.train.dflash_fixtures import (MASK_ID, assert_same_update, dflash_cfg, dflash_grads_setup,
                                                      gloo_dflash_worker, tiny_target)
from dflash_prep.tests.train.train_fakes import FakeSource

# small modules: 64 = 4 groups of 16 channels, rank 8, top 4 (the target's vocab is 300)
D2 = dict(objective="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
          selector_init="normal")


def _src(**kw):
    return FakeSource(n=48, layout="varlen", **kw)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
@pytest.mark.parametrize("recipe", [dict(D2, selector_missing="inject"), dict(D2, slot_weights="dpace", optimizer="muon")],
                         ids=["decay-inject", "dpace-drop"])
def test_selector_loss_over_two_ranks_equals_one_rank_two_accum(tmp_path, recipe):
    """2 gloo ranks x A=1 == 1 rank x A=2 (uneven anchors): the selector term shares the step's
    sum w, so the gradients and the update agree however the step is split."""
    target = str(tiny_target())
    mp.spawn(gloo_dflash_worker, args=(2, str(tmp_path / "init"), str(tmp_path), target, recipe), nprocs=2, join=True)
    got = torch.load(tmp_path / "dflash_grads.pt", weights_only=False)
    obj, opt, sb = dflash_grads_setup(target, 1, 2, 0, **recipe)
    assert sb.micro[0].n_anchors != sb.micro[1].n_anchors, "the test needs uneven anchor counts"
    init = {n: p.detach().clone() for n, p in obj.model.named_parameters()}
    st = train_step(obj.model, opt, sb, lr=1e-3, grad_clip=0.0, d=Dist(0, 1, 0, torch.device("cpu")),
                    autocast=contextlib.nullcontext, objective=obj)
    grads = {n: p.grad for n, p in obj.model.named_parameters()}
    # a fresh drafter's top 4 of 300 rarely holds the gold token: only inject trains the selector for sure
    trained = ("candidate_selector.successor_codebook",) if recipe.get("selector_missing") == "inject" else ()
    for n in trained + ( "candidate_selector.hidden_projection.weight",
              "layers.0.attention_conv.kernel_projection.weight", "layers.1.mlp_conv.base_kernel")[len(trained) == 0:]:
        assert grads[n].abs().sum() > 0, f"{n} gets no gradient"
    for n, g in grads.items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
    assert_same_update(got["params"], init, obj.model, opt)
    assert got["step"]["loss"] == pytest.approx(st["loss"], rel=1e-6)
    assert got["step"]["selector_loss"] == pytest.approx(st["selector_loss"], rel=1e-6, nan_ok=True)


def test_resume_is_bitwise_and_selector_metrics_are_logged(tmp_path, capsys):
    target = tiny_target()
    n, k = 4, 2
    a = train(dflash_cfg(tmp_path / "a", target, max_steps=n, **D2), source=_src(grad_accum=2))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dflash2 recipe:"))
    assert "selector rank 8 top-4 init normal" in line and "missing gold drop" in line, line
    train(dflash_cfg(tmp_path / "b", target, max_steps=k, **D2), source=_src(grad_accum=2))
    b = train(dflash_cfg(tmp_path / "b", target, max_steps=n, **D2), source=_src(grad_accum=2))
    assert a["global_step"] == b["global_step"] == n
    pa, pb = (ckpt.load(tmp_path / x / ckpt.CKPT_FILE)["model"] for x in "ab")
    assert "candidate_selector.predecessor_codebook" in pa and "layers.0.mlp_conv.base_kernel" in pa
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    recs = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()[1:]]
    for r in recs:
        assert 0.0 <= r["topk_recall"] <= 1.0       # selector_acc is over covered slots: null when none is
        assert (r["selector_acc"] is None) == (r["topk_recall"] == 0.0)
        assert r["selector_acc"] is None or 0.0 <= r["selector_acc"] <= 1.0
        assert r["selector_loss"] is None or r["selector_loss"] > 0 and 1.0 <= r["path_tau"] <= 4.0 and 1.0 <= r["tau"] <= 4.0
    contract = ckpt.load(tmp_path / "a" / ckpt.CKPT_FILE)["run_key"]["contract"]
    assert contract["objective"] == "dflash2" and contract["selector_rank"] == 8
    assert (contract["selector_missing"], contract["selector_init"], contract["init_from_drafter"]) == \
        ("drop", "normal", None)


def _pair(target, **kw):
    """A DFlash drafter and a fresh DFlash2 drafter (identity convolutions, zero successor
    codebook) holding the same DFlash weights."""
    from dflash_prep.train.objectives import build_objective

    v1 = build_objective(dflash_cfg("unused", target, **kw), _src().dataset, torch.device("cpu"))
    v2 = build_objective(dflash_cfg("unused", target, **{**D2, "selector_init": "zero", **kw}), _src().dataset,
                         torch.device("cpu"))
    missing = v2.model.load_state_dict(v1.model.state_dict(), strict=False).missing_keys
    assert missing and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    return v1, v2


def test_identity_dflash2_computes_dflash_hidden_states_bit_for_bit():
    v1, v2 = _pair(tiny_target())
    src = _src()
    m = src.manifest(0)
    for mb in list(m.microbatches(0))[:3]:
        b = v1.build(src.dataset, mb, 0, m.layout, False)
        with torch.no_grad():
            args = (v1.target.embed_tokens(b.noise_ids), v1.target.taps(b, epoch=0), b.position_ids, b.blk_pos,
                    b.cu_seqlens, b.cu_blk, b.anchors, 4)
            h1, h2 = v1.model(*args), v2.model(*args)
        assert torch.equal(h1, h2), (h1 - h2).abs().max()


def test_warm_start_proposes_the_dflash_drafters_tokens(tmp_path):
    """--init-from-drafter: at step 0 the DFlash2 drafter's selector walk proposes exactly the
    tokens the exported DFlash drafter proposes, on held-out contexts."""
    from dflash_prep.train.objectives import build_objective
    from dflash_prep.train.objectives.dflash.decode import DFlashProposer
    from dflash_prep.train.objectives.dflash.export import write_export
    from dflash_prep.train.objectives.dflash2.selector import unary_topk_from_hidden
    from dflash_prep.train.speculate import Target
    from transformers import AutoModelForCausalLM

    target = tiny_target()
    v1 = build_objective(dflash_cfg("unused", target), _src().dataset, torch.device("cpu"))
    write_export(v1.model, tmp_path / "v1", source={})
    v2 = build_objective(dflash_cfg("unused", target, **{**D2, "selector_init": "zero",
                                                        "init_from_drafter": str(tmp_path / "v1")}),
                         _src().dataset, torch.device("cpu"))
    assert v2.warm_start and v2.contract()["init_from_drafter"] == v2.warm_start
    tgt = Target(AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32),
                 v1.model.config.target_layer_ids)
    p1 = DFlashProposer(v1.model, tgt, block_size=4, mask_token_id=MASK_ID)
    g = torch.Generator().manual_seed(5)
    sel = v2.model.candidate_selector
    for start in (3, 9, 17):
        ids = torch.randint(3, 97, (start + 1,), generator=g)
        tgt.reset()
        _, feats = tgt.forward(ids[:start], 0)
        block = torch.tensor([int(ids[start])] + [MASK_ID] * 3)
        want = p1.propose(block, feats, start)
        with torch.no_grad():
            h = DFlashProposer(v2.model, tgt, block_size=4, mask_token_id=MASK_ID).hidden(block, feats, start)
            unary = unary_topk_from_hidden(h[None, 1:], tgt.model.get_output_embeddings().weight, sel.top_k)
            got = sel.propose(h[None, 1:], unary, block[:1])[0]
        assert torch.equal(got, want), (start, got, want)


def test_a_manifest_packed_for_other_sizes_is_refused():
    from dflash_prep.train.objectives.dflash2.drafter import DFlash2Config
    from dflash_prep.train.objectives.dflash2.objective import check_manifest_sizes

    c = SimpleNamespace(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    sizes = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    ok = SimpleNamespace(header={"options": {"objective": "dflash2"}, "dflash": sizes})
    check_manifest_sizes(c, ok, 0)
    check_manifest_sizes(c, SimpleNamespace(header={"options": {"objective": "dflash"}, "dflash": {}}), 0)
    bad = SimpleNamespace(header={"options": {"objective": "dflash2"}, "dflash": {**sizes, "selector_top_k": 16}})
    with pytest.raises(ConfigError, match="--selector-top-k 4"):
        check_manifest_sizes(c, bad, 3)
    assert DFlash2Config.__mro__[1].__name__ == "DrafterConfig"


@pytest.mark.parametrize("bad,match", [
    (dict(selector_missing="keep"), "--selector-missing"), (dict(selector_init="ones"), "--selector-init"),
    (dict(selector_loss_alpha=-1.0), "--selector-loss-alpha"), (dict(conv_group_size=0), "--conv-group-size"),
    (dict(conv_group_size=24), "conv"), (dict(conv_kernel_size=5), "conv"), (dict(selector_top_k=301), "top-k"),
])
def test_bad_dflash2_options_are_refused(bad, match):
    from dflash_prep.train.objectives import build_objective

    with pytest.raises(ConfigError, match=match):
        build_objective(dflash_cfg("unused", tiny_target(), **{**D2, **bad}), _src().dataset, torch.device("cpu"))


def test_dflash2_options_belong_to_dflash2():
    with pytest.raises(ConfigError, match="--selector-rank is an option of --objective dflash2"):
        dflash_cfg("unused", "t", selector_rank=8)

"""``--optimizer muon``: which parameters Muon takes, one state dict for both parts, the LR schedule
on both, and bitwise resume on CPU."""

from __future__ import annotations

import io

import pytest
import torch

from dflash_prep.errors import FormatError
from dflash_prep.train.config import build as build_config
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig
from dflash_prep.train.lr import Schedule
from dflash_prep.train.optim import MuonAdamW, build_optimizer, muon_split


def _drafter(seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=48, num_layers=2, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position=256, block_size=4, num_target_layers=4,
                        target_layer_ids=(0, 2), mask_token_id=1, vocab_size=50, attention_bias=True)
    return Drafter(cfg)


def test_muon_takes_the_matrices_adamw_the_rest():
    m = _drafter()
    mats, rest = muon_split(m)
    names = {id(p): n for n, p in m.named_parameters()}
    mats, rest = {names[id(p)] for p in mats}, {names[id(p)] for p in rest}
    assert "fc.weight" in mats and "layers.1.mlp.down_proj.weight" in mats and "layers.0.self_attn.q_proj.weight" in mats
    assert all(n.endswith((".bias", "norm.weight")) for n in rest), rest
    assert "layers.0.self_attn.q_proj.bias" in rest and "hidden_norm.weight" in rest
    assert mats | rest == set(names.values()) and not mats & rest
    # an LM's embedding (tied to its head) stays on AdamW
    from dflash_prep.train.config import ModelConfig
    from dflash_prep.train.objectives.lm.model import Decoder
    lm = Decoder(ModelConfig(vocab_size=40, n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48))
    lm_names = {id(p): n for n, p in lm.named_parameters()}
    assert "embed.weight" in {lm_names[id(p)] for p in muon_split(lm)[1]}


def _loss(m, g):
    x = torch.randn(6, 32 * 2, generator=g)
    return (m.fc(x).tanh() @ m.layers[0].mlp.gate_proj.weight.T).pow(2).mean() + m.norm.weight.pow(3).sum() \
        + m.layers[0].self_attn.q_proj.bias.sin().sum()


def _run(m, opt, sched, steps, start=0):
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        _loss(m, torch.Generator().manual_seed(s)).backward()
        for grp in opt.param_groups:
            grp["lr"] = sched(s) * grp.get("lr_scale", 1.0)
        opt.step()


def test_schedule_drives_both_and_resume_is_bitwise():
    cfg = build_config(optimizer="muon", lr=1e-3, device="cpu")
    sched = Schedule(peak=1e-3, warmup=2, total=8)
    a = _drafter()
    opt_a = build_optimizer(a, cfg)
    assert isinstance(opt_a, MuonAdamW)
    _run(a, opt_a, sched, 6)
    lrs = sorted({round(g["lr"], 12) for g in opt_a.param_groups})
    assert lrs == pytest.approx(sorted([sched(5), 10 * sched(5)]))  # Muon at 10 x --lr, both on the schedule

    b = _drafter()
    opt_b = build_optimizer(b, cfg)
    _run(b, opt_b, sched, 3)
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": opt_b.state_dict()}, buf)
    c = _drafter(seed=1)                                   # other weights: all must come from the checkpoint
    opt_c = build_optimizer(c, cfg)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert set(state["opt"]) == {"muon", "adamw"} and state["opt"]["muon"]["state"]
    c.load_state_dict(state["model"])
    opt_c.load_state_dict(state["opt"])
    _run(c, opt_c, sched, 3, start=3)
    for (n, pa), pc in zip(a.named_parameters(), c.parameters()):
        assert torch.equal(pa, pc), f"{n}: max diff {(pa - pc).abs().max().item()}"
    moved = _drafter()
    assert not torch.equal(moved.fc.weight, a.fc.weight)

    with pytest.raises(FormatError, match="optimizer"):
        opt_c.load_state_dict(torch.optim.AdamW(c.parameters()).state_dict())

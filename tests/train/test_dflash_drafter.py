"""The DFlash drafter module: public parameter names, the tap rule, and packed == public per block."""

import pytest
import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives.dflash.drafter import Drafter, DrafterConfig, build_target_layer_ids

from dflash_prep.tests.train.dflash_oracle import public_block_forward


def _cfg(**kw):
    base = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, num_layers=2, rms_norm_eps=1e-6,
                rope_theta=10000.0, max_position=256, block_size=4, num_target_layers=6,
                target_layer_ids=build_target_layer_ids(6, 2), mask_token_id=3, vocab_size=50)
    base.update(kw)
    return DrafterConfig(**base)


def test_target_layer_ids_rule():
    assert build_target_layer_ids(28, 1) == [14]
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(28, 3) == [1, 13, 25]
    assert build_target_layer_ids(4, 2) == [1, 1]
    with pytest.raises(ConfigError):
        build_target_layer_ids(3, 2)
    with pytest.raises(ConfigError, match="outside"):
        _cfg(target_layer_ids=(1, 6))
    with pytest.raises(ConfigError, match="block-size"):
        _cfg(block_size=1)
    with pytest.raises(ConfigError, match="sliding-window"):
        _cfg(sliding_window=3)  # below B = 4


def test_parameter_names_are_the_public_ones():
    d = Drafter(_cfg())
    want = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        want |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        want |= {f"layers.{i}.self_attn.{n}.weight" for n in ("q_norm", "k_norm")}
        want |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        want |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    assert set(d.state_dict()) == want
    assert d.state_dict()["fc.weight"].shape == (64, 2 * 64)
    assert tuple(d.state_dict()["layers.0.self_attn.k_proj.weight"].shape) == (2 * 16, 64)


def test_from_target_config():
    from transformers import Qwen3Config

    hc = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5e5, rms_norm_eps=1e-6)
    c = DrafterConfig.from_target_config(hc, num_layers=3, block_size=8, mask_token_id=299)
    assert (c.hidden, c.heads, c.kv_heads, c.head_dim, c.intermediate) == (64, 4, 2, 16, 96)
    assert c.target_layer_ids == (1, 3, 5) and c.num_target_layers == 8 and c.rope_theta == 5e5
    assert c.vocab_size == 300 and c.mask_token_id == 299 and c.block_size == 8 and not c.attention_bias
    assert DrafterConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("window", [0, 4, 6, 13])
def test_packed_forward_equals_public_block_forward(window):
    """Two documents, anchors incl. 0 and S-1, GQA: every block equals the public algorithm's
    output, with full attention and sliding windows below and above the longest context (9 + B)."""
    torch.manual_seed(0)
    cfg = _cfg(sliding_window=window)
    d = Drafter(cfg).double()
    B, k = cfg.block_size, cfg.num_taps
    lens = [9, 5]
    anchors = [[0, 3, 8], [1, 4]]
    feats = [torch.randn(n, k * cfg.hidden, dtype=torch.float64) for n in lens]
    noise = [torch.randn(len(a) * B, cfg.hidden, dtype=torch.float64) for a in anchors]
    cu_ctx = torch.tensor([0, 9, 14], dtype=torch.int32)
    cu_blk = torch.tensor([0, 3 * B, 5 * B], dtype=torch.int32)
    anc = torch.tensor(sum(anchors, []), dtype=torch.int32)
    ctx_pos = torch.cat([torch.arange(n) for n in lens])
    blk_pos = torch.cat([torch.arange(a, a + B) for a in anc.tolist()])
    out = d(torch.cat(noise), torch.cat(feats), ctx_pos, blk_pos, cu_ctx, cu_blk, anc, B)
    assert out.shape == (5 * B, cfg.hidden)
    row = 0
    for di, doc_anchors in enumerate(anchors):
        for j, a in enumerate(doc_anchors):
            want = public_block_forward(d, noise[di][j * B:(j + 1) * B], feats[di][:a], a, window=window)
            got = out[row:row + B]
            err = (got - want).abs().max().item()
            assert err < 1e-10, f"doc {di} anchor {a}: max |diff| {err:.3g}"
            row += B


def test_bad_shapes_are_refused():
    cfg = _cfg()
    d = Drafter(cfg)
    with pytest.raises(ValueError, match="target_feats"):
        d(torch.zeros(4, 64), torch.zeros(3, 64), torch.arange(3), torch.arange(4),
          torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
          torch.tensor([1], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("window", [0, 4])
def test_no_leak_block_loss_never_reaches_taps_at_or_past_its_anchor(backend, window):
    """Issue 23 item 6 through the whole drafter (2 layers): anchors side by side and closer than
    B (3, 4, 5, 7 at B = 4). Block j's loss has exactly zero gradient on the target taps at
    positions >= a_j of its document (and before its window), and on every other document."""
    from dflash_prep.kernels.attention import force_backend

    torch.manual_seed(1)
    cfg = _cfg(head_dim=32, heads=2, kv_heads=1, sliding_window=window)
    d = Drafter(cfg)
    B, lens, anchors = cfg.block_size, [12, 5], [[3, 4, 5, 7, 11], [0, 2]]
    feats = torch.randn(sum(lens), cfg.num_taps * cfg.hidden)
    noise = torch.randn(sum(map(len, anchors)) * B, cfg.hidden)
    cu_ctx = torch.tensor([0, 12, 17], dtype=torch.int32)
    cu_blk = torch.tensor([0, 5 * B, 7 * B], dtype=torch.int32)
    anc = torch.tensor(sum(anchors, []), dtype=torch.int32)
    ctx_pos = torch.cat([torch.arange(n) for n in lens])
    blk_pos = torch.cat([torch.arange(a, a + B) for a in anc.tolist()])
    starts = [0, 12]
    docs = [0] * 5 + [1] * 2
    for j, a in enumerate(anc.tolist()):
        taps = feats.clone().requires_grad_()
        with force_backend(backend):
            out = d(noise, taps, ctx_pos, blk_pos, cu_ctx, cu_blk, anc, B)
        (grad,) = torch.autograd.grad(out[j * B:(j + 1) * B].square().sum(), taps)
        lo = max(0, a - (window - 1)) if window else 0
        seen = torch.zeros(feats.shape[0], dtype=torch.bool)
        seen[starts[docs[j]] + lo:starts[docs[j]] + a] = True
        assert torch.equal(grad[~seen], torch.zeros_like(grad[~seen])), \
            f"{backend} W={window}: block {j} (a={a}) leaks into taps {torch.nonzero(grad[~seen].abs().sum(1))}"
        assert a == lo or grad[seen].abs().sum(1).gt(0).all()

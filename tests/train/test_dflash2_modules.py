"""DFlash2's convolution and candidate selector against their written-out formulas (CPU, float32)."""

import math

import pytest
import torch

from dflash_prep.errors import ConfigError
from dflash_prep.train.objectives.dflash2.conv import GroupedDynamicConv, grouped_conv
from dflash_prep.train.objectives.dflash2.selector import (
    CandidateSelector,
    Unary,
    brute_force_walk,
    greedy_walk,
    selector_loss,
    teacher_forced,
    transform_logits,
    unary_topk,
    unary_topk_from_hidden,
)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _close(a, b, atol=1e-6, rtol=1e-6):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    d = (a - b).abs()
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"max diff {d.max():.3e}, mean diff {d.mean():.3e}"


# ---------------------------------------------------------------------------------------------- conv


def _conv_loops(z, delta, base, B, gs):
    """``out[i, c] = sum_t (base[t, c] + delta[i, t, c // gs]) * z[i - t, c]`` for ``i % B >= t``."""
    Q, H = z.shape
    T = base.shape[0]
    out = torch.zeros(Q, H, dtype=torch.float64)
    for i in range(Q):
        for c in range(H):
            for t in range(T):
                if i % B >= t:
                    out[i, c] += (float(base[t, c]) + float(delta[i, t, c // gs])) * float(z[i - t, c])
    return out


def _random_conv(H=8, T=3, gs=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    conv = GroupedDynamicConv(H, T, gs)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.3)
    return conv, g


def test_grouped_conv_matches_loops():
    g = torch.Generator().manual_seed(1)
    Q, H, T, gs, B = 12, 8, 3, 2, 4                                  # 3 blocks of 4, 4 groups of 2
    z, delta = torch.randn(Q, H, generator=g), torch.randn(Q, T, H // gs, generator=g)
    base = torch.randn(T, H, generator=g)
    _close(grouped_conv(z, delta, base, B), _conv_loops(z, delta, base, B, gs))


def test_module_prepare_finish_matches_loops():
    """The projection's columns are (side, tap, group); the out-side delta comes from the input u."""
    conv, g = _random_conv()
    B, H, T, gs = 4, 8, 3, 2
    G = H // gs
    u = torch.randn(2 * B, H, generator=g)
    lin = torch.nn.Linear(H, H)
    sub = lambda x: torch.tanh(lin(x))  # noqa: E731  (a per-row sublayer)
    W = conv.kernel_projection.weight.detach()
    D = (u @ W.t()).double()                                          # (Q, 2*T*G)
    d_in = torch.stack([D[:, 0 * T * G + t * G: 0 * T * G + (t + 1) * G] for t in range(T)], dim=1)
    d_out = torch.stack([D[:, 1 * T * G + t * G: 1 * T * G + (t + 1) * G] for t in range(T)], dim=1)
    base = conv.base_kernel.detach()
    z_ref = _conv_loops(u, d_in, base[0], B, gs)
    with torch.no_grad():
        y = sub(z_ref.float())
        out = conv(u, sub, B)
        z, d = conv.prepare(u, B)
    _close(z, z_ref, atol=1e-5)
    _close(d, d_out, atol=1e-5)
    _close(out, _conv_loops(y, d_out, base[1], B, gs), atol=1e-5)


def test_block_output_has_no_gradient_from_other_blocks_or_later_slots():
    conv, g = _random_conv(seed=2)
    B, H = 4, 8
    lin = torch.nn.Linear(H, H)
    sub = lambda x: torch.nn.functional.silu(lin(x))  # noqa: E731
    u = torch.randn(3 * B, H, generator=g, requires_grad=True)
    out = conv(u, sub, B)
    for row in range(3 * B):
        (grad,) = torch.autograd.grad(out[row].sum(), u, retain_graph=True)
        j, r = divmod(row, B)
        seen = torch.zeros(3 * B, dtype=torch.bool)
        seen[j * B: j * B + r + 1] = True                             # its own block, slots <= r
        assert torch.count_nonzero(grad[~seen]) == 0, f"row {row} reads rows outside slots {j}.0..{j}.{r}"
        assert torch.count_nonzero(grad[row]) > 0


def test_identity_init_is_bit_exact():
    torch.manual_seed(3)
    B, H = 4, 16
    conv = GroupedDynamicConv(H, 2, 4)
    sub = torch.nn.Linear(H, H)
    for dtype in (torch.float32, torch.bfloat16):
        u = torch.randn(3 * B, H).to(dtype)
        c, s = conv.to(dtype), sub.to(dtype)
        with torch.no_grad():
            z, d = c.prepare(u, B)
            y = s(u)
            assert torch.equal(z, u) and torch.equal(c.finish(y, d, B), y)
            assert torch.equal(c(u, s, B), y)
            if dtype == torch.float32:
                assert _bits_equal(z, u) and _bits_equal(c(u, s, B), y)


def test_conv_parameter_names_shapes_and_checks():
    conv = GroupedDynamicConv(64, 2, 16)
    shapes = {k: tuple(v.shape) for k, v in conv.state_dict().items()}
    assert shapes == {"base_kernel": (2, 2, 64), "kernel_projection.weight": (2 * 2 * 4, 64)}
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, 64)) and not conv.base_kernel[:, 1].any()
    with pytest.raises(ConfigError):
        GroupedDynamicConv(64, 2, 12)
    with pytest.raises(ConfigError):
        GroupedDynamicConv(64, 0, 16)
    with pytest.raises(ConfigError):
        conv.prepare(torch.zeros(8, 64), 1)                           # 2 taps > block of 1
    with pytest.raises(ValueError):
        conv.prepare(torch.zeros(6, 64), 4)                           # not whole blocks


# ------------------------------------------------------------------------------------------ selector


def test_unary_topk_orders_ties_by_id_and_handles_a_tie_at_the_cut():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0, 2.0],           # a tie at the cut (ids 2, 5)
                           [0.0, 1.0, 1.0, 1.0, 1.0, 5.0],           # four-way tie at the cut
                           [2.0, 5.0, 0.0, 5.0, 1.0, 0.0]])          # a tie inside the top 3 only
    u = unary_topk(logits, 3, gold=torch.tensor([4, 0, 3]))
    assert u.ids.tolist() == [[1, 3, 2], [5, 1, 2], [1, 3, 0]]        # value desc, then lowest id
    assert u.values.tolist() == [[3.0, 3.0, 2.0], [5.0, 1.0, 1.0], [5.0, 5.0, 2.0]]
    assert u.gold_values.tolist() == [0.0, 0.0, 5.0]
    assert (u.ids[..., 0] == logits.argmax(-1)).all()


def test_unary_from_hidden_matches_dense_logits_and_gradient():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 5, 8, generator=g)
    W = torch.randn(40, 8, generator=g)
    gold = torch.randint(0, 40, (2, 5), generator=g)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    dense = unary_topk(transform_logits(h1 @ W.t(), 0.5, 3.0), 6, gold)
    chunked = unary_topk_from_hidden(h2, W, 6, gold, output_multiplier=0.5, softcap=3.0, chunk_rows=3)
    assert torch.equal(dense.ids, chunked.ids)
    _close(dense.values, chunked.values)
    _close(dense.gold_values, chunked.gold_values)
    (dense.values.sum() + dense.gold_values.sum()).backward()
    (chunked.values.sum() + chunked.gold_values.sum()).backward()
    _close(h1.grad, h2.grad, atol=1e-5)


def _hand_selector():
    """V = 6, H = R = 2, P = identity, hand-set codebooks."""
    sel = CandidateSelector(2, 6, 2, 3)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.copy_(torch.tensor([[1., 0], [0, 1], [1, 1], [2, 0], [0, 2], [1, -1]]))
        sel.successor_codebook.copy_(torch.tensor([[0., 1], [1, 0], [1, 1], [-1, 0], [0, -1], [2, 1]]))
    return sel


def _edge(sel, p, h, c):
    A, Bk = sel.predecessor_codebook.tolist(), sel.successor_codebook.tolist()
    return sum(A[p][i] * h[i] * Bk[c][i] for i in range(2))


def _ce(scores, label):
    return math.log(sum(math.exp(s) for s in scores)) - scores[label]


def test_selector_loss_by_hand_inject_and_drop():
    sel = _hand_selector()
    hidden = torch.tensor([[0.5, -1.0], [1.0, 2.0], [0.3, 0.3]])
    unary = Unary(values=torch.tensor([[2.0, 1.0, 0.5], [1.5, 1.0, 0.0], [3.0, 2.0, 1.0]]),
                  ids=torch.tensor([[1, 4, 5], [0, 2, 3], [3, 1, 0]]),
                  gold_values=torch.tensor([1.0, -0.5, 1.0]))
    pred, gold = torch.tensor([2, 3, 1]), torch.tensor([4, 5, 0])     # slot 0 covered (index 1), slot 1 missing
    w = torch.tensor([1.0, 0.5, 0.0])                                 # slot 2 has no target
    # slot 0: A[2] * h = [0.5, -1]; edges to B[1], B[4], B[5] = 0.5, 1.0, 0.0
    s0 = [2.0 + 0.5, 1.0 + 1.0, 0.5 + 0.0]
    # slot 1 (inject): A[3] * h = [2, 0]; candidates 0, 2 and the gold 5 in place of 3 (unary -0.5)
    s1_inj = [1.5 + 0.0, 1.0 + 2.0, -0.5 + 4.0]
    h = hidden.tolist()
    assert s0 == [u + _edge(sel, 2, h[0], c) for u, c in zip([2.0, 1.0, 0.5], [1, 4, 5])]
    assert s1_inj == [u + _edge(sel, 3, h[1], c) for u, c in zip([1.5, 1.0, -0.5], [0, 2, 5])]
    drop = selector_loss(sel, hidden, unary, pred, gold, w, missing="drop")
    inject = selector_loss(sel, hidden, unary, pred, gold, w, missing="inject")
    _close(drop.loss, _ce(s0, 1), atol=1e-5)
    _close(inject.loss, _ce(s0, 1) + 0.5 * _ce(s1_inj, 2), atol=1e-5)
    assert float(drop.weight_sum) == 1.0 and float(inject.weight_sum) == 1.5
    for r in (drop, inject):  # serving semantics: 2 weighted slots, 1 covered, its argmax (0) misses
        assert [float(x) for x in r.stat_vector()[1:]] == [2.0, 1.0, 0.0, 0.0]
        assert r.recall == 0.5 and r.accuracy == 0.0 and r.unary_accuracy == 0.0
    with pytest.raises(ConfigError):
        selector_loss(sel, hidden, unary._replace(gold_values=None), pred, gold, w, missing="inject")
    with pytest.raises(ConfigError):
        selector_loss(sel, hidden, unary, pred, gold, w, missing="skip")


def test_selector_loss_gradients_and_detach():
    torch.manual_seed(5)
    sel = CandidateSelector(4, 12, 3, 4, init="normal")
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    logits = torch.randn(2, 3, 12, requires_grad=True)
    block = torch.randint(0, 12, (2, 4))
    pred, gold = teacher_forced(block)
    u = unary_topk(logits, 4, gold)
    out = selector_loss(sel, hidden, u, pred, gold, torch.ones(2, 3), missing="inject")
    out.loss.backward()
    assert hidden.grad.abs().sum() > 0 and logits.grad.abs().sum() > 0 and sel.successor_codebook.grad.abs().sum() > 0
    hidden.grad = logits.grad = None
    selector_loss(sel, hidden, u, pred, gold, torch.ones(2, 3), missing="inject", detach=True).loss.backward()
    assert hidden.grad is None and logits.grad is None


def test_lattice_rows_are_the_stepwise_scores():
    torch.manual_seed(6)
    sel = CandidateSelector(4, 20, 3, 3, init="normal")
    hidden, logits = torch.randn(2, 3, 4), torch.randn(2, 3, 20)
    u, anchors = unary_topk(logits, 3), torch.tensor([7, 11])
    with torch.no_grad():
        lat = sel.lattice(hidden, u, anchors)
        for s in range(3):
            for p in range(3):
                prev = anchors if s == 0 else u.ids[:, s - 1, p]
                _close(lat[:, s, p], sel.scores(hidden[:, s], Unary(u.values[:, s], u.ids[:, s]), prev), atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_walk_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    N, S, K = 5, 3, 3
    lat = torch.randn(N, S, K, K, generator=g)
    lat[:, 0] = lat[:, 0, :1]                                         # slot 1: every row is the anchor
    ties = torch.randint(0, 3, (N, S, K, K), generator=g).float()     # many ties: lowest index wins
    ties[:, 0] = ties[:, 0, :1]
    cands = torch.randint(0, 100, (N, S, K), generator=g)
    for lattice in (lat, ties):
        tok, idx = greedy_walk(lattice, cands)
        bt, bi = brute_force_walk(lattice, cands)
        assert torch.equal(idx, bi) and torch.equal(tok, bt)
    sel = CandidateSelector(4, 16, 2, K, init="normal")               # end to end, with unary ties
    with torch.no_grad():
        sel.successor_codebook.copy_(torch.randint(-1, 2, (16, 2), generator=g).float())
        sel.predecessor_codebook.copy_(torch.randint(-1, 2, (16, 2), generator=g).float())
        sel.hidden_projection.weight.copy_(torch.randint(-1, 2, (2, 4), generator=g).float())
        hidden = torch.randint(-1, 2, (N, S, 4), generator=g).float()
        u = unary_topk(torch.randint(0, 3, (N, S, 16), generator=g).float(), K)
        anchors = torch.randint(0, 16, (N,), generator=g)
        lattice = sel.lattice(hidden, u, anchors)
        assert torch.equal(sel.propose(hidden, u, anchors), brute_force_walk(lattice, u.ids)[0])


def test_zero_init_walk_is_the_per_slot_argmax():
    g = torch.Generator().manual_seed(7)
    sel = CandidateSelector(8, 10, 4, 4)                              # init="zero"
    assert not sel.successor_codebook.any() and sel.predecessor_codebook.any()
    hidden = torch.randn(6, 5, 8, generator=g)
    logits = torch.randint(0, 4, (6, 5, 10), generator=g).float()     # ties everywhere
    u = unary_topk(logits, 4)
    anchors = torch.randint(0, 10, (6,), generator=g)
    assert torch.equal(sel.propose(hidden, u, anchors), logits.argmax(-1))
    assert torch.equal(sel.lattice(hidden, u, anchors), u.values[:, :, None, :].expand(6, 5, 4, 4))
    W = torch.randn(10, 8, generator=g)                              # the chunked path agrees
    u2 = unary_topk_from_hidden(hidden, W, 4, chunk_rows=7)
    assert torch.equal(sel.propose(hidden, u2, anchors), (hidden @ W.t()).argmax(-1))


def test_selector_parameter_names_shapes_and_checks():
    sel = CandidateSelector(32, 50, 8, 4)
    shapes = {k: tuple(v.shape) for k, v in sel.state_dict().items()}
    assert shapes == {"hidden_projection.weight": (8, 32), "predecessor_codebook": (50, 8),
                      "successor_codebook": (50, 8)}
    for bad in (dict(rank=0), dict(top_k=51), dict(init="ones")):
        kw = dict(hidden=32, vocab_size=50, rank=8, top_k=4) | bad
        with pytest.raises(ConfigError):
            CandidateSelector(**kw)
    with pytest.raises(ConfigError):
        brute_force_walk(torch.zeros(1, 12, 4, 4), torch.zeros(1, 12, 4, dtype=torch.long))


def _drafter_module():
    try:
        from dflash_prep.train.objectives.dflash import drafter
    except ImportError:
        drafter = pytest.importorskip("dflash_prep.train.drafter")
    return drafter


def test_fresh_convolutions_around_a_dflash_drafter_give_its_hidden_states_bit_for_bit():
    """Attached the public way (each sublayer's normalised input in, its output out), identity
    convolutions leave the DFlash drafter's packed forward unchanged, bit for bit."""
    drafter = _drafter_module()
    from dflash_prep.train.layers import rope_tables

    torch.manual_seed(8)
    B = 4
    cfg = drafter.DrafterConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=48, num_layers=2,
                                rms_norm_eps=1e-6, rope_theta=10000.0, max_position=64, block_size=B,
                                num_target_layers=4, target_layer_ids=(1, 2), mask_token_id=0, vocab_size=50)
    d = drafter.Drafter(cfg).eval()
    convs = [(GroupedDynamicConv(32, 2, 8), GroupedDynamicConv(32, 2, 8)) for _ in d.layers]
    cu_ctx, cu_blk = torch.tensor([0, 7, 12], dtype=torch.int32), torch.tensor([0, 2 * B, 3 * B], dtype=torch.int32)
    anchors = torch.tensor([2, 5, 3], dtype=torch.int32)
    ctx_pos = torch.cat((torch.arange(7), torch.arange(5)))
    blk_pos = (anchors.long()[:, None] + torch.arange(B)).reshape(-1)
    noise, feats = torch.randn(3 * B, 32), torch.randn(12, 64)
    with torch.no_grad():
        want = d(noise, feats, ctx_pos, blk_pos, cu_ctx, cu_blk, anchors)
        ctx = d.hidden_norm(d.fc(feats))
        rc, rb = rope_tables(ctx_pos, 8, 10000.0, ctx.dtype), rope_tables(blk_pos, 8, 10000.0, noise.dtype)
        x = noise
        for layer, (attn_conv, mlp_conv) in zip(d.layers, convs):
            attn = lambda z: layer.self_attn(z, ctx, rc, rb, cu_ctx, cu_blk, anchors, B)  # noqa: E731
            x = x + attn_conv(layer.input_layernorm(x), attn, B)
            x = x + mlp_conv(layer.post_attention_layernorm(x), layer.mlp, B)
        got = d.norm(x)
    assert _bits_equal(got, want)

"""EAGLE-3 TTT attention: the Triton kernels (under TRITON_INTERPRET=1 on CPU) against the fp32
reference, the reference against SDPA with the explicit mask, exact zero gradients on every key a
query must not see, and one step equal to the causal varlen attention.

Kernel cases check the forward and all three gradients with FlashAttention's rule (error against
an fp32 reference at most 2x that of a same-precision PyTorch implementation). Together they
cover: S = 1, 3 and 7 steps; q holding all steps or only the last ones (the per-step call of a TTT
loop); uneven, zero-length and length-1 documents and document borders inside a tile (the
interpreter's fwd/dQ tiles are 32 queries x 16 keys, dK/dV 16 x 32); GQA (4,2), (4,1), (2,1) and
MHA; D in {32, 64, 128}; fp32/fp16/bf16; a large sm_scale. The GPU tiles are compiled ahead of
time for sm_90 (bf16 D = 128 by default, other dtypes ``slow``); the compiled kernels are checked
on a real GPU by the ``gpu`` test.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash_prep.kernels.attention import attention_varlen, force_backend, ttt_attention
from dflash_prep.kernels.errors import AttentionConfigError, AttentionInputError
from dflash_prep.kernels.ttt_reference import ttt_attention_reference, ttt_mask

from dflash_prep.tests.kernels.helpers import close_to_reference
from dflash_prep.tests.kernels.test_compile import ROOT, SM90_SMEM, _compile_script

NAMES = ("o", "dq", "dk", "dv")


def make_ttt(doc_lens, q_steps, k_steps, hq, hkv, d, dtype, seed=0):
    """(q [Sq,T,Hq,D], k, v [Sk,T,Hkv,D], do [Sq,T,Hq,D], cu_seqlens int32, max_seqlen), on CPU."""
    g = torch.Generator().manual_seed(seed)
    total = int(sum(doc_lens))
    cu = torch.zeros(len(doc_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(doc_lens, dtype=torch.int64), 0).to(torch.int32)
    q = torch.randn(q_steps, total, hq, d, generator=g).to(dtype)
    k = torch.randn(k_steps, total, hkv, d, generator=g).to(dtype)
    v = torch.randn(k_steps, total, hkv, d, generator=g).to(dtype)
    do = torch.randn(q_steps, total, hq, d, generator=g).to(dtype)
    return q, k, v, do, cu, max(doc_lens, default=0)


def run(fn, q, k, v, do, *args, **kwargs):
    """(o, dq, dk, dv) of ``fn`` for upstream gradient ``do``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v, *args, **kwargs)
    return (o.detach(), *torch.autograd.grad(o, (q, k, v), do))


def _check(doc_lens, q_steps, k_steps, hq, hkv, d, dtype, seed=0, sm_scale=None):
    q, k, v, do, cu, max_len = make_ttt(doc_lens, q_steps, k_steps, hq, hkv, d, dtype, seed)
    got = run(ttt_attention, q, k, v, do, cu, max_len, sm_scale=sm_scale, backend="triton")
    ref = run(ttt_attention_reference, q.float(), k.float(), v.float(), do.float(), cu, max_len, sm_scale=sm_scale)
    same = run(ttt_attention_reference, q, k, v, do, cu, max_len, sm_scale=sm_scale, upcast=False)
    for name, g, r, s in zip(NAMES, got, ref, same):
        assert g.dtype == dtype and g.shape == s.shape, name
        assert torch.isfinite(g.float()).all(), f"{name}: not finite"
        close_to_reference(f"ttt {doc_lens} Sq={q_steps} Sk={k_steps} ({hq},{hkv}) D={d} {dtype} {name}", g, r, s)
    return got


@pytest.mark.parametrize("doc_lens,q_steps,k_steps,heads,d,dtype,sm_scale", [
    ([17, 0, 1, 40, 6], 3, 3, (4, 2), 64, torch.bfloat16, None),  # S=3, all steps in one call
    ([33, 1, 20], 1, 1, (4, 1), 32, torch.float16, None),  # S=1: the causal varlen attention
    ([40, 9], 1, 3, (2, 2), 32, torch.bfloat16, None),  # the per-step call: q of step 2 only
    ([30, 5], 2, 4, (4, 2), 32, torch.float32, None),  # q holds steps 2 and 3 of 4
    ([18, 5], 7, 7, (2, 1), 32, torch.bfloat16, 1.0),  # the default 7 steps, logits ~6x larger
    ([20, 13], 2, 2, (2, 1), 128, torch.float16, None),
], ids=["s3-bf16-d64", "s1-fp16", "per-step", "last-2-of-4-fp32", "s7-large-scale", "d128"])
def test_kernel_matches_reference(doc_lens, q_steps, k_steps, heads, d, dtype, sm_scale):
    _check(doc_lens, q_steps, k_steps, *heads, d, dtype, sm_scale=sm_scale)


def test_other_tile_shapes(monkeypatch):
    from dflash_prep.kernels import ttt_fwd

    monkeypatch.setattr(ttt_fwd, "INTERPRET_BLOCKS", {"fwd": (16, 16, 4, 1), "dq": (16, 16, 4, 1),
                                                      "dkdv": (16, 16, 4, 1), "diag": (16, 16, 4, 1)})
    _check([5, 0, 26], 3, 3, 2, 1, 32, torch.float32, seed=4)


@pytest.mark.parametrize("q_steps,k_steps,heads", [(3, 3, (4, 2)), (1, 4, (2, 2)), (2, 3, (4, 1)), (1, 1, (2, 1))])
def test_reference_equals_sdpa_with_the_explicit_mask(q_steps, k_steps, heads):
    q, k, v, _, cu, max_len = make_ttt([7, 0, 1, 12], q_steps, k_steps, *heads, 16, torch.float64, seed=2)
    steps_t = q.shape[1]
    mask = ttt_mask(cu, q_steps, k_steps)  # (Sq*T, Sk*T)
    assert mask.shape == (q_steps * steps_t, k_steps * steps_t) and bool(mask.any(-1).all())  # no empty row
    flat = [t.permute(2, 0, 1, 3).reshape(t.shape[2], -1, t.shape[3]) for t in (q, k, v)]  # (H, steps*T, D)
    o = F.scaled_dot_product_attention(*flat, attn_mask=mask, enable_gqa=True)
    o = o.reshape(heads[0], q_steps, steps_t, 16).permute(1, 2, 0, 3)  # (Sq, T, Hq, D)
    torch.testing.assert_close(ttt_attention_reference(q, k, v, cu, max_len), o, rtol=1e-12, atol=1e-12)


def test_mask_rule_spelled_out():
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)  # documents {0, 1} and {2}
    m = ttt_mask(cu, 2, 3).reshape(2, 3, 3, 3)  # (query step, token, key step, token); q holds steps 1, 2
    assert m[0, 1, 0].tolist() == [True, True, False]  # step 1, token 1: step-0 keys 0..1 of its document
    assert m[0, 1, 1].tolist() == [False, True, False] and not m[0, 1, 2].any()  # own token at step 1 only
    assert m[1, 2, 0].tolist() == [False, False, True]  # token 2 starts a document
    assert m[1, 2, 1].tolist() == m[1, 2, 2].tolist() == [False, False, True]  # step 2 sees steps 1 and 2


# doc borders at 12 and 13 (a 1-token document); queries: first/last tokens, steps 0..2
LEAK_DOCS = [12, 1, 20]
LEAK_QUERIES = [(0, 0), (2, 12), (1, 13), (2, 32), (0, 20)]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_query_has_exactly_zero_gradient_on_every_key_it_must_not_see(backend):
    """Other documents, future tokens, diagonal keys of later steps or other tokens, and the key/value
    heads of other GQA groups all get exactly 0 (not close) from one query's loss; every key it
    sees gets some."""
    q, k, v, _, cu, max_len = make_ttt(LEAK_DOCS, 3, 3, 4, 2, 32, torch.float32, seed=7)
    starts = cu.tolist()
    g = torch.Generator().manual_seed(3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = ttt_attention(*leaves, cu, max_len, backend=backend)  # one forward, one backward per query
    head = 1  # group 2: reads key/value head 0 only
    for iq, t in LEAK_QUERIES:
        loss = (o[iq, t, head] * torch.randn(32, generator=g)).sum()
        dq, dk, dv = torch.autograd.grad(loss, leaves, retain_graph=True)
        doc_start = max(s for s in starts[:-1] if s <= t)  # no zero-length documents here
        seen = torch.zeros(3, q.shape[1], 2, dtype=torch.bool)  # (key step, token, kv head)
        seen[0, doc_start:t + 1, 0] = True
        seen[1:iq + 1, t, 0] = True  # Sq = Sk: query step iq is step iq
        for name, grad in (("dk", dk), ("dv", dv)):
            per_key = grad.abs().sum(-1)  # (Sk, T, Hkv)
            assert torch.equal(per_key[~seen], torch.zeros_like(per_key[~seen])), (
                f"{backend}: query (step {iq}, token {t}) leaks into {name} at {torch.nonzero(per_key * ~seen)[:4]}")
            if name == "dv" or int(seen.sum()) > 1:  # one visible key: softmax = 1, its dK is exactly 0
                assert per_key[seen].gt(0).all(), f"{backend}: {name}: a visible key got no gradient"
        own = torch.zeros(dq.shape[:3], dtype=torch.bool)
        own[iq, t, head] = True
        assert torch.equal(dq[~own], torch.zeros_like(dq[~own])), f"{backend}: dq outside query ({iq}, {t})"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_one_step_is_the_causal_varlen_attention(backend):
    q, k, v, do, cu, max_len = make_ttt([17, 1, 40], 1, 1, 4, 2, 32, torch.bfloat16, seed=5)
    got = run(ttt_attention, q, k, v, do, cu, max_len, backend=backend)
    with force_backend(backend):
        want = run(attention_varlen, q[0], k[0], v[0], do[0], cu, max_len)
    for name, a, b in zip(NAMES, got, want):
        if backend == "triton":  # the same loops over the same tiles: bitwise
            assert torch.equal(a[0], b), f"{name} differs from attention_varlen"
        else:  # the reference sums in another order
            torch.testing.assert_close(a[0], b, rtol=2e-2, atol=2e-2)


def test_three_dim_q_is_the_newest_step():
    q, k, v, do, cu, max_len = make_ttt([9, 14], 1, 3, 2, 1, 32, torch.float32, seed=6)
    got = run(ttt_attention, q[0], k, v, do[0], cu, max_len, backend="triton")
    want = run(ttt_attention, q, k, v, do, cu, max_len, backend="triton")
    assert got[0].shape == q.shape[1:]
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b if name in ("dk", "dv") else b[0]), name


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_autocast_casts_the_inputs_first(backend):
    q, k, v, _, cu, max_len = make_ttt([6, 11], 2, 2, 2, 1, 32, torch.float32, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = ttt_attention(q, k, v, cu, max_len, backend=backend)
    want = ttt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, max_len, backend=backend)
    assert o.dtype == torch.bfloat16 and torch.equal(o, want)


def test_lse_is_the_natural_log_sum_exp_over_what_each_row_sees():
    from dflash_prep.kernels import ttt
    from dflash_prep.kernels.inputs import check_ttt

    q, k, v, _, cu, max_len = make_ttt([9, 1, 22], 2, 3, 4, 2, 32, torch.float32, seed=1)
    _, lse = ttt.ttt_triton(q, k, v, cu, check_ttt(q, k, v, cu, max_len, None), return_lse=True)  # (Sq, Hq, T)
    total = q.shape[1]
    qf = q.permute(2, 0, 1, 3).reshape(4, -1, 32)  # (Hq, Sq*T, D)
    kf = k.permute(2, 0, 1, 3).reshape(2, -1, 32).repeat_interleave(2, 0)  # (Hq, Sk*T, D)
    scores = (qf @ kf.transpose(1, 2) / math.sqrt(32)).masked_fill(~ttt_mask(cu, 2, 3), float("-inf"))
    want = torch.logsumexp(scores, -1).reshape(4, 2, total).transpose(0, 1)  # (Sq, Hq, T)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)


def test_bitwise_deterministic_across_runs():
    q, k, v, do, cu, max_len = make_ttt([21, 3], 3, 3, 2, 1, 32, torch.bfloat16, seed=3)
    first = run(ttt_attention, q, k, v, do, cu, max_len, backend="triton")
    second = run(ttt_attention, q, k, v, do, cu, max_len, backend="triton")
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_empty_batch():
    q, k, v, do, cu, _ = make_ttt([0, 0], 2, 2, 2, 1, 32, torch.float32)
    o, dq, dk, dv = run(ttt_attention, q, k, v, do, cu, 0, backend="triton")
    assert o.shape == dq.shape == (2, 0, 2, 32) and dk.shape == dv.shape == (2, 0, 1, 32)


def test_dispatch_backend_argument_beats_force_backend():
    q, k, v, _, cu, max_len = make_ttt([5, 3], 2, 2, 2, 1, 48, torch.float32)  # D = 48: the reference only
    with force_backend("triton"):
        with pytest.raises(AttentionConfigError, match="head dims"):
            ttt_attention(q, k, v, cu, max_len)  # auto defers to the forced triton
        ttt_attention(q, k, v, cu, max_len, backend="reference")
    ttt_attention(q, k, v, cu, max_len)  # auto on CPU: the reference
    with pytest.raises(AttentionConfigError, match="unknown backend"):
        ttt_attention(q, k, v, cu, max_len, backend="cuda")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_inputs_are_clear_errors(backend):
    q, k, v, _, cu, max_len = make_ttt([5, 3], 3, 2, 2, 1, 32, torch.float32)
    with pytest.raises(AttentionConfigError, match="1 <= Sq <= Sk"):
        ttt_attention(q, k, v, cu, max_len, backend=backend)  # more query steps than key steps
    with pytest.raises(AttentionConfigError, match="same shape"):
        ttt_attention(q[:2], k, v[:1], cu, max_len, backend=backend)
    with pytest.raises(AttentionConfigError, match=r"\[steps, T, heads, D\]"):
        ttt_attention(q[:2], k[0], v[0], cu, max_len, backend=backend)
    with pytest.raises(AttentionInputError, match="ttt_attention .*exceeds max_seqlen"):
        ttt_attention(q[:2], k, v, cu, 4, backend=backend)


SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dflash_prep.kernels import ttt_bwd, ttt_fwd

dtype, d = sys.argv[1], int(sys.argv[2])
kernels = {"fwd": ttt_fwd.ttt_fwd_kernel, "dq": ttt_bwd.ttt_bwd_dq_kernel, "dkdv": ttt_bwd.ttt_bwd_dkdv_kernel,
           "diag": ttt_bwd.ttt_bwd_dkdv_diag_kernel}
out = []
for name, kernel in kernels.items():
    bm, bn, warps, stages = ttt_fwd.FIXED_BLOCKS[128 if d > 64 else 64][name]
    consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, UPCAST=False, PRECISION="ieee" if dtype == "fp32" else "tf32")
    sig, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
            continue
        sig[arg] = ("*i32" if arg in ("STARTS", "LENS") else "*fp32" if arg in ("LSE", "DELTA") else "*" + dtype
                    if arg.isupper() else "fp32" if arg in ("qk_scale", "sm_scale") else "i32")
        if sig[arg].startswith("*") or (arg.startswith("s") and sig[arg] == "i32"):  # as a launch specializes them
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    out.append(dict(kernel=name, d=d, shared=compiled.metadata.shared, ptx="ld.global" in compiled.asm["ptx"]))
print(json.dumps(out))
"""


@pytest.mark.parametrize("dtype,d", [("bf16", 128)] + [pytest.param(*c, marks=pytest.mark.slow)
                                                       for c in (("bf16", 64), ("fp16", 128), ("fp32", 64))])
def test_ttt_kernels_compile_for_sm90(dtype, d):
    """The fixed GPU tiles compile for an H100/H200 without a GPU (ahead of time, down to a cubin; about
    12 s per dtype and D): what the interpreter cannot catch (types in constexpr branches, layouts, shared memory)."""
    results = _compile_script(SCRIPT, dtype, str(d))
    assert {r["kernel"] for r in results} == {"fwd", "dq", "dkdv", "diag"}
    for r in results:
        assert r["ptx"] and r["shared"] <= SM90_SMEM, r  # the diagonal dK/dV kernel uses no shared memory


GPU_SCRIPT = r"""
import torch
from dflash_prep.bench.attention_ttt import TTTBenchConfig, correctness, make_case

for tokens, doc_len, steps, heads, d in [(4096, 2048, 7, (32, 8), 128), (1000, 100, 3, (8, 2), 64), (520, 260, 1, (4, 4), 128)]:
    cfg = TTTBenchConfig(tokens=(tokens,), doc_len=doc_len, steps=steps, heads_q=heads[0], heads_kv=heads[1], head_dim=d)
    leaves, cu, max_seqlen = make_case(cfg, tokens, torch.device("cuda"))
    res = correctness(leaves, cu, max_seqlen, torch.randn_like(leaves[0]))
    assert res["passed"], (tokens, doc_len, steps, heads, d, res)
    print("ok", tokens, steps, heads, d, flush=True)
"""


@pytest.mark.gpu
def test_compiled_ttt_kernels_match_reference_on_gpu():
    """Compiled kernels on a real GPU (no interpreter) at sizes the interpreter cannot reach, through
    the GPU check's own correctness routine (bench.attention_ttt), in a subprocess."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode:
        pytest.fail(f"GPU check failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert proc.stdout.count("ok ") == 3

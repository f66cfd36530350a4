"""``--target-engine vllm --states CACHE``: the trainer reads a states cache instead of running the
target (train/cached_taps.py). The caches here are written from the transformers target over the
same micro-batches (tests/train/states_fixtures.py), so the cached run must equal the colocated
one bit for bit; vLLM-built caches are tested in tests/engine/."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_prep.errors import ConfigError, FingerprintMismatch
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.loop import train

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target
from dflash_prep.tests.train.eagle3_fixtures import eagle3_cfg, eagle3_source
from dflash_prep.tests.train.states_fixtures import assert_same_drafter, cache_from_target
from dflash_prep.tests.train.train_fakes import FakeSource


CASES = {
    # objective, source, config maker, stored taps, final, run options
    "dflash-ce": ("dflash", lambda: FakeSource(n=48, layout="varlen", grad_accum=2), dflash_cfg, (1,), False, {}),
    "dflash-kl": ("dflash", lambda: FakeSource(n=48, layout="varlen", grad_accum=2), dflash_cfg, (1,), True,
                  dict(loss="kl", slot_weights="dpace", optimizer="muon")),
    "eagle3": ("eagle3", eagle3_source, eagle3_cfg, (0, 1, 2), True, {}),
    "dflash2": ("dflash2", lambda: FakeSource(n=48, layout="varlen", grad_accum=2), dflash_cfg, (1,), False,
                dict(objective="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                     selector_init="normal")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_run_equals_colocated_bit_for_bit(tmp_path, case):
    """Same data, steps and seed: the drafter trained on the cache's states is the drafter trained
    beside the target (every loss, every weight), and the contract names the engine and dtype."""
    _, make_src, make_cfg, taps, final, opts = CASES[case]
    target = tiny_target()
    src = make_src()
    steps = min(4, src.manifest(0).num_steps)
    cache_from_target(tmp_path / "cache", src, target, taps, final=final)
    a = train(make_cfg(tmp_path / "hf", target, max_steps=steps, **opts), source=make_src())
    b = train(make_cfg(tmp_path / "vllm", target, max_steps=steps, target_engine="vllm", states=str(tmp_path / "cache"),
                       **opts), source=make_src())
    assert a["global_step"] == b["global_step"] == steps
    assert "states_read" not in a
    got = b["states_read"]    # every micro-batch's states were read on the prefetch thread, none in the step
    assert got["on_step"] == 0 and got["ahead"] >= steps * src.manifest(0).grad_accum, got
    ca, cb = assert_same_drafter(tmp_path / "hf", tmp_path / "vllm")
    assert "target_engine" not in ca and "states_dtype" not in ca       # hf runs keep their contract
    assert {k: v for k, v in cb.items() if k not in ("target_engine", "states_dtype")} == ca
    assert (cb["target_engine"], cb["states_dtype"]) == ("vllm", "fp32")


def test_cached_resume_is_bitwise_and_a_cache_of_another_dtype_is_refused(tmp_path):
    """k steps + resume == n straight steps across an epoch edge; resuming on an fp8 cache of the
    same states is another run (the contract's states_dtype)."""
    target = tiny_target()
    src = lambda: FakeSource(n=48, layout="varlen", grad_accum=2)  # noqa: E731
    cache_from_target(tmp_path / "c32", src(), target, (1,), final=False)
    cache_from_target(tmp_path / "c8", src(), target, (1,), final=False, dtype="fp8")
    per_epoch = src().manifest(0).num_steps
    n, k = per_epoch + 2, per_epoch - 1
    kw = dict(epochs=2, target_engine="vllm", states=str(tmp_path / "c32"))
    a = train(dflash_cfg(tmp_path / "a", target, max_steps=n, **kw), source=src())
    train(dflash_cfg(tmp_path / "b", target, max_steps=k, **kw), source=src())
    b = train(dflash_cfg(tmp_path / "b", target, max_steps=n, **kw), source=src())
    assert a["global_step"] == b["global_step"] == n and b["steps"] == n - k
    assert_same_drafter(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ckpt.PlanChanged, match="states_dtype: checkpoint 'fp32' -> now 'fp8'"):
        train(dflash_cfg(tmp_path / "a", target, max_steps=n + 1, **{**kw, "states": str(tmp_path / "c8")}),
              source=src())


def test_taps_are_a_pure_function_of_the_sample_ids(tmp_path):
    """A micro-batch's cached taps are its documents' taps concatenated, bit for bit, however the
    documents are grouped or ordered (what partition invariance and a new world size rest on)."""
    from dflash_prep.formats.states import open_states
    from dflash_prep.train.cached_taps import CachedTaps
    from dflash_prep.train.split.taps import load_heads

    target = tiny_target()
    src = FakeSource(n=48, layout="varlen")
    cache_from_target(tmp_path / "c", src, target, (1, 2), final=True, dtype="fp8")
    embed, head = load_heads(target, device=torch.device("cpu"))
    p = CachedTaps(open_states(tmp_path / "c"), [2, 1, 2], final=True, embed_tokens=embed, lm_head=head, num_layers=4,
                   device=torch.device("cpu"))
    lens = src.dataset.lengths

    class B:
        def __init__(self, sids):
            self.sample_ids = np.asarray(sids)
            self.cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lens[self.sample_ids])]), dtype=torch.int32)
            self.input_ids = torch.zeros(int(self.cu_seqlens[-1]))

    one = {s: p.taps(B([s]), epoch=0, final=True) for s in (3, 17, 40)}
    for order in ([3, 17, 40], [40, 3, 17]):
        feats, last = p.taps(B(order), epoch=1, final=True)
        assert torch.equal(feats, torch.cat([one[s][0] for s in order]))
        assert torch.equal(last, torch.cat([one[s][1] for s in order]))
        ahead = B(order)                          # read ahead (the prefetch thread's path): the same values
        p.read_ahead(ahead)
        got = p.taps(ahead, epoch=1, final=True)
        assert torch.equal(got[0], feats) and torch.equal(got[1], last)
        assert torch.equal(p.taps(ahead, epoch=1), feats)
    assert p.summary()["states_read"]["ahead"] == 2 and p.summary()["states_read"]["on_step"] == 5
    H = 64
    f3 = one[3][0]
    assert f3.shape == (lens[3], 3 * H) and torch.equal(f3[:, :H], f3[:, 2 * H:])   # tap 2 twice, in the run's order


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "`dflash-prep extract " in msg, msg
    return msg


def test_a_cache_for_other_data_target_or_taps_is_refused_in_one_line(tmp_path):
    target = tiny_target()
    src = FakeSource(n=48, layout="varlen", grad_accum=2)
    cache_from_target(tmp_path / "c", src, target, (1,), final=False, dtype="bf16")
    kw = dict(max_steps=1, target_engine="vllm", states=str(tmp_path / "c"))
    with pytest.raises(FingerprintMismatch) as e:
        train(dflash_cfg(tmp_path / "r1", target, **kw), source=FakeSource(n=40, layout="varlen", grad_accum=2))
    assert "was built for dataset" in _one_line(e)
    with pytest.raises(FingerprintMismatch) as e:
        train(dflash_cfg(tmp_path / "r2", tiny_target(1), **kw), source=src)
    assert "was built from target" in _one_line(e)
    with pytest.raises(FingerprintMismatch) as e:
        train(dflash_cfg(tmp_path / "r3", target, draft_layers=1, **kw), source=src)   # taps [2]
    msg = _one_line(e)
    assert "holds taps [1], the run reads [2]" in msg and "--draft-layers 1" in msg and "--dtype bf16" in msg
    with pytest.raises(FingerprintMismatch) as e:
        train(dflash_cfg(tmp_path / "r4", target, loss="kl", **kw), source=src)
    msg = _one_line(e)
    assert "no final hidden state" in msg and "--loss kl" in msg


def test_engine_options_are_checked():
    target = str(tiny_target())
    online = dflash_cfg("o", target, target_engine="vllm", states_dtype="fp8", engine_args=("dtype=float32",),
                        engine_tokens=1)       # without --states: the target in vLLM, online
    assert (online.states, online.states_dtype, online.engine_tokens) == ("", "fp8", 1)
    with pytest.raises(ConfigError, match="--states CACHE is read by --target-engine vllm"):
        dflash_cfg("o", target, states="c")
    with pytest.raises(ConfigError, match="must be one of hf, vllm"):
        dflash_cfg("o", target, target_engine="sglang")
    with pytest.raises(ConfigError, match="every drafter rank reads the cache itself.*drop --target-ranks"):
        dflash_cfg("o", target, target_engine="vllm", states="c", target_ranks=1)
    split = dflash_cfg("o", target, target_engine="vllm", target_ranks=1, engine_tokens=1)   # vLLM on the target ranks
    assert (split.target_ranks, split.target_engine, split.states) == (1, "vllm", "")
    with pytest.raises(ConfigError, match="a cache has its own, given to `dflash-prep extract`"):
        dflash_cfg("o", target, target_engine="vllm", states="c", states_dtype="fp8")
    with pytest.raises(ConfigError, match="add --target-engine vllm, or drop them"):
        dflash_cfg("o", target, engine_args=("tensor_parallel_size=2",))
    with pytest.raises(ConfigError, match="--states-dtype must be one of bf16, fp8, fp32"):
        dflash_cfg("o", target, target_engine="vllm", states_dtype="int8")
    with pytest.raises(ConfigError, match="--engine-tokens must be at least 1"):
        dflash_cfg("o", target, target_engine="vllm", engine_tokens=0)
    from dflash_prep.train.config import build

    with pytest.raises(ConfigError, match="--objective lm trains on no frozen target"):
        build(objective="lm", target_engine="vllm", states="c")

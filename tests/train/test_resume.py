"""Resume is exact (bitwise on CPU); a changed plan is refused; --from-scratch starts over."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_prep.errors import FormatError
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.config import TrainConfig, build as build_config
from dflash_prep.train.loop import train

from dflash_prep.tests.train.train_fakes import FakeSource

SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)


def _cfg(out, **kw) -> TrainConfig:
    base = dict(out=str(out), model="tiny", model_overrides=SMALL, progress=False, prefetch=2, warmup_steps=2,
                lr=1e-2, device="cpu")
    base.update(kw)
    return build_config(**base)


def _params(out) -> dict:
    return ckpt.load(out / ckpt.CKPT_FILE)["model"]


@pytest.mark.parametrize("edge", [False, True])
def test_resume_is_bitwise_equal_to_a_straight_run(tmp_path, edge):
    """N = E0 + 2 steps over 2 epochs: straight vs k, checkpoint, resume (k = E0 is the epoch edge)."""
    src = FakeSource(n=48, grad_accum=2)
    e0 = src.manifest(0).num_steps
    assert e0 >= 4
    n, k = e0 + 2, (e0 if edge else 3)
    a = train(_cfg(tmp_path / "a", epochs=2, max_steps=n), source=src)
    train(_cfg(tmp_path / "b", epochs=2, max_steps=k), source=FakeSource(n=48, grad_accum=2))
    b = train(_cfg(tmp_path / "b", epochs=2, max_steps=n), source=FakeSource(n=48, grad_accum=2))
    assert a["global_step"] == b["global_step"] == n
    assert a["cursor"] == b["cursor"] == {"epoch": 1, "step": 2}
    assert b["steps"] == n - k
    pa, pb = _params(tmp_path / "a"), _params(tmp_path / "b")
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"{name}: max diff {(pa[name] - pb[name]).abs().max().item()}"
    sa = ckpt.load(tmp_path / "a" / ckpt.CKPT_FILE)["optimizer"]["state"]
    sb = ckpt.load(tmp_path / "b" / ckpt.CKPT_FILE)["optimizer"]["state"]
    for i in sa:
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])
    # the resumed run appended to the log: one header, then records for steps 1..n exactly once
    recs = [json.loads(x) for x in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert recs[0]["format"] == "dflash-prep/train-log"
    assert [r["global_step"] for r in recs[1:]] == list(range(1, n + 1))
    # and the changed-run check really is sensitive: one more step changes the parameters
    c = train(_cfg(tmp_path / "b", epochs=2, max_steps=n + 1), source=FakeSource(n=48, grad_accum=2))
    assert c["global_step"] == n + 1
    assert not torch.equal(_params(tmp_path / "b")["embed.weight"], pa["embed.weight"])


def test_log_and_summary_fields(tmp_path):
    s = train(_cfg(tmp_path, max_steps=4), source=FakeSource(n=48))
    recs = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()[1:]]
    assert len(recs) == 4
    for r in recs:
        for key in ("loss", "lr", "grad_norm", "real_tokens", "padded_tokens", "efficiency", "tokens_per_s",
                    "data_wait_s", "data_wait_share"):
            assert key in r
        assert 0 < r["efficiency"] <= 1 and r["real_tokens"] <= r["padded_tokens"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["format"] == "dflash-prep/train-summary" and summary["steps"] == s["steps"] == 4
    assert summary["real_tokens"] == sum(r["real_tokens"] for r in recs)


@pytest.mark.parametrize("change,field", [
    (dict(plan="plan-b", boundaries=(10, 30)), "plan.boundaries"),  # new boundaries -> new plan fingerprint
    (dict(plan="plan-c", seed=1), "plan.seed"),                     # new seed
    (dict(budget=128), "plan.budget"),                              # budget
    (dict(layout="varlen"), "layout"),                              # layout
    (dict(grad_accum=2), "grad_accum"),                             # accumulation (steps are not elastic)
])
def test_resume_under_a_changed_plan_is_refused_then_from_scratch_works(tmp_path, change, field):
    train(_cfg(tmp_path, max_steps=2), source=FakeSource(n=48))
    before = (tmp_path / ckpt.CKPT_FILE).read_bytes()
    with pytest.raises(ckpt.PlanChanged) as ei:
        train(_cfg(tmp_path, max_steps=4), source=FakeSource(n=48, **change))
    msg = str(ei.value)
    assert "refusing to resume" in msg and "--from-scratch" in msg and "checkpoint" in msg
    assert f"  {field}: checkpoint " in msg  # names the exact field that changed
    assert (tmp_path / ckpt.CKPT_FILE).read_bytes() == before  # nothing was overwritten
    s = train(_cfg(tmp_path, max_steps=3, from_scratch=True), source=FakeSource(n=48, **change))
    assert s["global_step"] == 3 and s["steps"] == 3  # a new run from step 0
    state = ckpt.load(tmp_path / ckpt.CKPT_FILE)
    new_src = FakeSource(n=48, **change)
    assert state["run_key"]["plan_fingerprint"] == new_src.plan_fingerprint
    assert state["run_key"]["layout"] == new_src.layout
    # and the new run now resumes normally under its own plan
    s2 = train(_cfg(tmp_path, max_steps=4), source=FakeSource(n=48, **change))
    assert s2["global_step"] == 4 and s2["steps"] == 1


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    train(_cfg(tmp_path, max_steps=1), source=FakeSource(n=48))
    p = tmp_path / ckpt.CKPT_FILE
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(FormatError, match="from-scratch"):
        train(_cfg(tmp_path, max_steps=2), source=FakeSource(n=48))


def test_world_size_mismatch_names_the_fix(tmp_path):
    with pytest.raises(Exception, match="world size 2"):
        train(_cfg(tmp_path, max_steps=1), source=FakeSource(n=48, world_size=2))

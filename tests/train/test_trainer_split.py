"""The trainer with target ranks (issue 22, phase 2): ``train()`` on K = 1 target + W = 2 drafter
gloo processes against the colocated W = 2 run on the same `pack --objective dflash` manifests
(2 epochs x 3 steps, A = 2): the same losses and weights, the manifest's length mix step by
step, resume across K, --rescale onto fewer and onto more drafter ranks, and SIGKILL of either
side. Every job has a hard deadline (CPU, fp32, one thread per process: bit-identical across
process layouts).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

from dflash_prep.train import checkpoint as ckpt
from dflash_prep.tests.train.split_fixtures import build_pipeline, open_source
from dflash_prep.tests.train.trainer_split_fixtures import base_cfg, log_records, run_job

pytestmark = [pytest.mark.jobs,  # whole gloo jobs: `make test-jobs` (and CI), not `make test`
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]

STEPS = 6   # 2 epochs x 3 steps


def test_split_options_are_checked_and_lm_has_no_target_to_split():
    from dflash_prep.errors import ConfigError
    from dflash_prep.train.config import TrainConfig, field_help, build as build_config
    from dflash_prep.train.objectives import build_objective, serve_target

    for kw, msg in ((dict(target_ranks=-1), "--target-ranks must be >= 0"),
                    (dict(target_prefetch=0), "--target-prefetch >= 1"),
                    (dict(target_timeout=0.0), "--target-timeout must be a finite number > 0")):
        with pytest.raises(ConfigError, match=msg):
            build_config(**kw)
    assert {"target_ranks", "target_prefetch", "target_timeout"} <= set(field_help(TrainConfig))
    cfg = build_config(target_ranks=1)
    with pytest.raises(ConfigError, match="--objective lm has no frozen target to put on its own ranks"):
        build_objective(cfg, None, torch.device("cpu"), place=object())
    with pytest.raises(ConfigError, match="--objective lm has no frozen target"):
        serve_target(cfg, object(), None)


def _ok(job: dict, world: int) -> None:
    errs = {r: job[r].get("trace") or job[r].get("error") for r in range(world) if r in job and "error" in job[r]}
    assert job["exit"] == [0] * world and not errs, f"exit codes {job['exit']}: {errs}"


def _weights(out) -> dict:
    return ckpt.load(out / ckpt.CKPT_FILE)["model"]


def _same_weights(a, b) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    diff = {k: float((wa[k] - wb[k]).abs().max()) for k in wa if not torch.equal(wa[k], wb[k])}
    assert not diff, f"drafter weights differ (max abs diff per tensor): {diff}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The pipeline, a straight colocated run and a straight split run (K = 1, W = 2)."""
    root = tmp_path_factory.mktemp("trainer-split")
    paths = build_pipeline(root / "pipe")
    colo = run_job(root / "colo-job", base_cfg(paths, root / "colo"), 2)
    _ok(colo, 2)
    split = run_job(root / "split-job", base_cfg(paths, root / "split", target_ranks=1), 3)
    _ok(split, 3)
    return {"root": root, "paths": paths, "colo": root / "colo", "split": root / "split", "split_job": split}


def test_one_target_rank_two_drafters_equal_the_colocated_run(runs):
    a, b = log_records(runs["colo"]), log_records(runs["split"])
    assert [r["global_step"] for r in a] == [r["global_step"] for r in b] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["tau"] for r in a] == [r["tau"] for r in b]
    _same_weights(runs["colo"], runs["split"])
    # the split run logs where the time went, and the target rank served every step
    for r in b:
        assert 0.0 <= r["target_busy_frac"] <= 1.0 and 0.0 <= r["drafter_wait_frac"] <= 1.0
        assert r["bytes_sent"] > 0 and 1 <= r["messages_in_flight"] <= 2 * 2 + 2
    target = runs["split_job"][0]["summary"]
    assert target["role"] == "target" and target["steps"] == STEPS and target["served"] == [0, 1]
    import json

    written = json.loads((runs["split"] / "target-rank0.json").read_text())   # what it returned (and printed)
    assert (written.pop("format"), written.pop("version")) == ("dflash-prep/train-target-summary", 1)
    assert written == json.loads(json.dumps(target))
    s = json.loads((runs["split"] / "summary.json").read_text())
    assert s["bottleneck"] in ("target", "drafter") and 1 <= s["suggested_target_ranks"] <= 2
    assert (s["target_ranks"], s["drafter_ranks"], s["world_size"]) == (1, 2, 2)


def test_the_drafters_train_on_the_manifests_length_mix_step_by_step(runs):
    """A ready/depth buffer in front of the drafters (the seeds' design) hands out whichever
    micro-batches its target workers finished and its depth rule releases first; on this corpus
    the steps alternate between many short conversations and a few near ``max_len`` ones (the
    per-step token counts below differ), and a target finishes a long micro-batch's forward no
    sooner but fills a token-depth threshold with fewer messages, so such a buffer drifts toward
    the long ones. Here the drafters take the target's messages in manifest order: every step's
    real tokens and anchors are those of the manifest's rows of that step, over both ranks."""
    src = open_source(runs["paths"])
    want = []
    for epoch in (0, 1):
        m = src.manifest(epoch)
        for s in range(m.num_steps):
            want.append(sum(int(mb.real_tokens) for r in range(2) for mb in m.microbatches(r, s) if mb.step == s))
    assert len(set(want)) > 2, f"the corpus must vary the per-step token count, got {want}"
    got = log_records(runs["split"])
    assert [r["real_tokens"] for r in got] == want
    assert [r["anchors"] for r in got] == [r["anchors"] for r in log_records(runs["colo"])]


@pytest.mark.parametrize("first,then", [(0, 1), (1, 0)], ids=["colocated-then-split", "split-then-colocated"])
def test_resume_across_target_ranks_exactly_once(runs, first, then):
    """3 steps under one K, the rest resumed under the other: steps 1..6 logged once each, the
    losses of the resumed steps and the final weights those of the straight run."""
    root, paths = runs["root"], runs["paths"]
    out = root / f"resume-{first}-{then}"
    shutil.rmtree(out, ignore_errors=True)
    job = run_job(root / f"r1-{first}", base_cfg(paths, out, target_ranks=first, max_steps=3), 2 + first)
    _ok(job, 2 + first)
    job = run_job(root / f"r2-{then}", base_cfg(paths, out, target_ranks=then), 2 + then)
    _ok(job, 2 + then)
    got, want = log_records(out), log_records(runs["colo"])
    assert [r["global_step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["real_tokens"] for r in got] == [r["real_tokens"] for r in want]
    _same_weights(out, runs["colo"])


def test_sigkill_of_the_target_rank_stops_the_drafters_within_the_timeout(runs):
    root, paths = runs["root"], runs["paths"]
    out, timeout = root / "kill-target", 8.0
    shutil.rmtree(out, ignore_errors=True)
    cfg = base_cfg(paths, out, target_ranks=1, ckpt_every=1, target_timeout=timeout)
    job = run_job(root / "kt-job", cfg, 3, kill=(0, 2), deadline=90.0)
    assert job["killed_at"] is not None, "the run ended before the kill"
    assert job["exit"][0] == -9 and job["exit"][1:] == [1, 1], job["exit"]
    # each drafter ends with one line; the first to notice names the target rank, the other names
    # either it or that drafter (whose own line says why: the drafters' all-gather broke with it)
    lines = [job[r]["error"] for r in (1, 2)]
    assert all("\n" not in line for line in lines), lines
    assert any("target rank 0" in line and " step " in line for line in lines), lines
    assert all("target rank 0" in line or "stopped or died" in line for line in lines), lines
    for r in (1, 2):
        assert job[r]["t_end"] - job["killed_at"] < timeout + 5.0
    state = ckpt.load(out / ckpt.CKPT_FILE)   # intact: the last checkpoint of a whole step
    done = int(state["cursor"]["global_step"])
    assert done >= 2
    job = run_job(root / "kt-resume", base_cfg(paths, out), 2)   # and resumable, here colocated
    _ok(job, 2)
    assert [r["loss"] for r in log_records(out)] == [r["loss"] for r in log_records(runs["colo"])]
    _same_weights(out, runs["colo"])


def test_sigkill_of_a_drafter_rank_makes_the_target_rank_exit(runs):
    root, paths = runs["root"], runs["paths"]
    out, timeout = root / "kill-drafter", 8.0
    shutil.rmtree(out, ignore_errors=True)
    cfg = base_cfg(paths, out, target_ranks=1, target_timeout=timeout)
    job = run_job(root / "kd-job", cfg, 3, kill=(2, 1), deadline=90.0)
    assert job["killed_at"] is not None, "the run ended before the kill"
    assert job["exit"][2] == -9 and job["exit"][0] == 1 and job["exit"][1] != 0, job["exit"]
    assert job[0]["t_end"] - job["killed_at"] < timeout + 5.0
    assert "drafter rank" in job[0]["error"] and "\n" not in job[0]["error"], job[0]["error"]


def test_rescale_resume_onto_fewer_drafter_ranks_with_a_target_rank(runs):
    """W = 2 (split) for 2 steps of epoch 0, then --rescale onto W' = 1 drafter + 1 target rank:
    the rest of the epoch comes from its continuation, re-packed for W' on the fly, and the
    target rank serves exactly it: the resumed steps hold the tokens and anchors of the straight
    run's rest of epoch 0, each sample once."""
    root, paths = runs["root"], runs["paths"]
    out = root / "rescale"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root / "pipe" / "man" / "resume", ignore_errors=True)
    job = run_job(root / "rs1", base_cfg(paths, out, target_ranks=1, max_steps=2, epochs=1), 3)
    _ok(job, 3)
    job = run_job(root / "rs2", base_cfg(paths, out, target_ranks=1, epochs=1, rescale=True), 2)
    _ok(job, 2)
    got, want = log_records(out), log_records(runs["colo"])[:3]       # epoch 0: 3 steps
    rest = got[2:]
    assert [r["global_step"] for r in got] == list(range(1, len(got) + 1)) and rest
    assert [r["loss"] for r in got[:2]] == [r["loss"] for r in want[:2]]
    assert sum(r["real_tokens"] for r in rest) == want[2]["real_tokens"]
    assert sum(r["anchors"] for r in rest) == want[2]["anchors"]
    assert job[0]["summary"]["steps"] == len(rest) and job[0]["summary"]["served"] == [0]


def test_kl_dpace_muon_split_equals_colocated(runs):
    """--loss kl: the target rank also sends its final hidden states; with D-PACE (the normaliser
    after the forward) and Muon, 2 steps split equal 2 steps colocated, bit for bit."""
    root, paths = runs["root"], runs["paths"]
    recipe = dict(loss="kl", kl_temperature=2.0, slot_weights="dpace", optimizer="muon", max_steps=2)
    outs = {}
    for K in (0, 1):
        outs[K] = root / f"kl-{K}"
        shutil.rmtree(outs[K], ignore_errors=True)
        _ok(run_job(root / f"kl-job-{K}", base_cfg(paths, outs[K], target_ranks=K, **recipe), 2 + K), 2 + K)
    a, b = log_records(outs[0]), log_records(outs[1])
    assert len(a) == 2 and [r["loss"] for r in a] == [r["loss"] for r in b]
    _same_weights(outs[0], outs[1])


def test_rescale_resume_onto_more_drafter_ranks_with_a_target_rank(runs):
    """The reverse: W = 1 drafter + 1 target rank for 2 steps of epoch 0 (manifests packed for
    W = 1 from the same data and plan), then --rescale onto W' = 2 drafters + 1 target rank. The
    continuation is re-packed for W' = 2 and the target rank serves both drafters; every sample
    of the epoch is trained exactly once (the parent's first 2 steps, then the continuation), and
    each resumed step holds the tokens and anchors of its continuation rows."""
    import json

    import numpy as np

    from dflash_prep.formats import manifest
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.verify import verify_epoch

    from dflash_prep.tests.train.split_fixtures import BLOCK, MAX_ANCHORS

    root, paths, k = runs["root"], runs["paths"], 2
    man, out = root / "man-w1", root / "rescale-up"
    for d in (man, out):
        shutil.rmtree(d, ignore_errors=True)
    opts = drafter_options(target_config=paths["target"], draft_layers=1, block_size=BLOCK, max_anchors=MAX_ANCHORS,
                           sliding_window=0)
    [d0] = pack_epochs(plan=paths["plan"], epochs=[0], out=man, data=paths["data"],
                       config=PackConfig(objective="dflash", options=opts, world_size=1, grad_accum=2))
    parent = manifest.open(d0)
    assert parent.world_size == 1 and parent.num_steps > k + 1, parent.num_steps
    w1 = {**paths, "manifests": str(man)}
    job = run_job(root / "ru1", base_cfg(w1, out, target_ranks=1, max_steps=k, epochs=1), 2)
    _ok(job, 2)
    assert job[0]["summary"]["served"] == [0] and job[0]["summary"]["steps"] == k
    job = run_job(root / "ru2", base_cfg(w1, out, target_ranks=1, epochs=1, rescale=True), 3)
    _ok(job, 3)
    cont = manifest.open(man / "resume" / "epoch-0000")
    assert cont.world_size == 2 and cont.header["resume"]["from_step"] == k and cont.num_steps > 0
    verify_epoch(cont.path)                            # exactly-once coverage with the parent
    got = log_records(out)
    assert [r["global_step"] for r in got] == list(range(1, k + cont.num_steps + 1))
    assert [r["step"] for r in got] == list(range(k + cont.num_steps))
    # what each logged step read: the parent's rows of steps 0..k-1, then both ranks of the continuation
    steps = {s: [mb for mb in parent.microbatches(0) if mb.step == s] for s in range(parent.num_steps)}
    cont_steps = {k + s: [mb for w in range(2) for mb in cont.microbatches(w) if mb.step == s]
                  for s in range(cont.num_steps)}
    kc = {}
    for m in (parent, cont):
        kc.update(zip(m.sample_ids.tolist(), m.arrays["anchor_counts"].tolist()))
    read = {**{s: steps[s] for s in range(k)}, **cont_steps}
    for r in got:
        mbs = read[r["step"]]
        assert r["real_tokens"] == sum(int(mb.real_tokens) for mb in mbs)
        assert r["anchors"] == sum(kc[int(i)] for mb in mbs for i in mb.sample_ids)
    # the resumed steps hold exactly the W = 1 epoch's remaining micro-batches, in tokens and anchors
    rest, left = got[k:], [mb for s in range(k, parent.num_steps) for mb in steps[s]]
    assert sum(r["real_tokens"] for r in rest) == sum(int(mb.real_tokens) for mb in left)
    assert sum(r["anchors"] for r in rest) == sum(kc[int(i)] for mb in left for i in mb.sample_ids)
    ids = np.concatenate([mb.sample_ids for mbs in read.values() for mb in mbs] + [cont.dropped_ids])
    n = len(open_source(paths).dataset)
    assert np.array_equal(np.bincount(ids, minlength=n), np.ones(n, np.int64)), "not exactly once"
    left_ids = np.concatenate([mb.sample_ids for mb in left])
    cont_ids = np.concatenate([mb.sample_ids for mbs in cont_steps.values() for mb in mbs] + [cont.dropped_ids])
    assert sorted(left_ids.tolist() + parent.dropped_ids.tolist()) == sorted(cont_ids.tolist())
    target = job[0]["summary"]
    assert target["role"] == "target" and target["served"] == [0, 1] and target["steps"] == cont.num_steps
    s = json.loads((out / "summary.json").read_text())
    assert (s["target_ranks"], s["drafter_ranks"], s["world_size"]) == (1, 2, 2)
    state = ckpt.load(out / ckpt.CKPT_FILE)
    assert state["run_key"]["world_size"] == 2 and state["run_key"]["continuation"]["from_step"] == k
    assert state["cursor"] == {"epoch": 1, "step": 0, "global_step": k + cont.num_steps}


def test_dflash2_split_equals_colocated(runs):
    """--objective dflash2 with one target rank: DFlash's target worker serves the variant
    unchanged; 2 steps split equal 2 steps colocated (losses, selector metrics, every weight of
    the convolutions and the selector), bit for bit."""
    root, paths = runs["root"], runs["paths"]
    recipe = dict(objective="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                  selector_init="normal", selector_missing="inject", max_steps=2)
    outs = {}
    for K in (0, 1):
        outs[K] = root / f"d2-{K}"
        shutil.rmtree(outs[K], ignore_errors=True)
        _ok(run_job(root / f"d2-job-{K}", base_cfg(paths, outs[K], target_ranks=K, **recipe), 2 + K), 2 + K)
    a, b = log_records(outs[0]), log_records(outs[1])
    assert len(a) == 2
    for key in ("loss", "selector_loss", "topk_recall", "path_tau"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert "candidate_selector.successor_codebook" in _weights(outs[0])
    _same_weights(outs[0], outs[1])


def test_eagle3_split_equals_colocated(runs):
    """--objective eagle3 with one target rank: it sends the three taps and the final hidden
    states of the same micro-batches; 2 steps split equal 2 steps colocated, bit for bit."""
    from dflash_prep.objectives import options as opt_decl
    from dflash_prep.objectives.eagle3 import Eagle3Options
    from dflash_prep.pack.pack import PackConfig, pack_epochs

    root, paths = runs["root"], runs["paths"]
    man = root / "man-eagle3"
    if not man.exists():
        o = opt_decl.from_flags(Eagle3Options, "pack", {"target_config": paths["target"], "draft_vocab_size": 64,
                                                        "ttt_steps": 3})
        pack_epochs(plan=paths["plan"], epochs=[0, 1], out=man,
                    config=PackConfig(objective="eagle3", options=o, world_size=2, grad_accum=2, layout="varlen"))
    outs = {}
    for K in (0, 1):
        outs[K] = root / f"e3-{K}"
        shutil.rmtree(outs[K], ignore_errors=True)
        cfg = {k: v for k, v in base_cfg(paths, outs[K], target_ranks=K, max_steps=2).items()
               if k not in ("draft_layers", "slot_weights", "sliding_window")}
        cfg.update(objective="eagle3", manifests=str(man), target_layer_ids=(0, 1, 2))
        _ok(run_job(root / f"e3-job-{K}", cfg, 2 + K), 2 + K)
    a, b = log_records(outs[0]), log_records(outs[1])
    assert len(a) == 2 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["step_acc"] for r in a] == [r["step_acc"] for r in b]
    assert "midlayer.self_attn.q_proj.weight" in _weights(outs[0])
    _same_weights(outs[0], outs[1])

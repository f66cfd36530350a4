"""Target ranks feeding drafter ranks (issue 22, phase 1): roles, the tagged transport, the
target rank's loop and the drafter's taps provider, over real gloo processes and real
`pack --objective dflash` manifests for W = 2.

Every spawned job is bounded: a rank still alive past its deadline is killed and the test fails.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.train.split.roles import Roles
from dflash_prep.train.split.link import HEADER_LEN, KIND_DATA, Tag, decode_header, encode_header, sample_digest
from dflash_prep.tests.train.split_fixtures import build_pipeline, open_source, split_rank, supervise

pytestmark = [pytest.mark.jobs,  # whole gloo jobs: `make test-jobs` (and CI), not `make test`
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]


# ----------------------------------------------------------------------------- in-process units
def test_roles_round_robin_and_validation():
    r = Roles(2, 5)
    assert r.world_size == 7 and [r.is_target(g) for g in range(7)] == [True, True] + [False] * 5
    assert [r.target_of(i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert r.served(0) == [0, 2, 4] and r.served(1) == [1, 3]
    assert [r.drafter_global(i) for i in range(5)] == [2, 3, 4, 5, 6] and r.drafter_index(4) == 2
    assert sorted(i for k in range(2) for i in r.served(k)) == list(range(5))
    for k, w in ((0, 2), (3, 2)):
        with pytest.raises(ConfigError, match=rf"--target-ranks {k} with manifests packed for {w} drafter ranks.*1\.\.{w}"):
            Roles(k, w)
    with pytest.raises(ConfigError, match=r"needs 1 \+ 2 = 3 processes, but this job has 4.*--target-ranks 2"):
        Roles(1, 2).check_world(4)
    Roles(1, 2).check_world(3)


def test_header_round_trip_digest_and_foreign_messages():
    taps, ids = torch.zeros(7, 12), torch.arange(5, dtype=torch.int32)
    tag = Tag.of(1, 4, 2, [9, 3, 5])
    kind, got, specs = decode_header(encode_header(KIND_DATA, tag, [taps, ids]), peer="p")
    assert (kind, got) == (KIND_DATA, tag)
    assert specs == [(torch.float32, (7, 12)), (torch.int32, (5,))]
    assert sample_digest([9, 3, 5]) != sample_digest([3, 9, 5]) != sample_digest([9, 3])
    assert sample_digest(np.array([9, 3, 5], np.int32)) == tag.digest          # dtype-independent
    bad = encode_header(KIND_DATA, tag, [taps])
    bad[0] = 7
    with pytest.raises(FormatError, match="not a target-link"):
        decode_header(bad, peer="target rank 0")
    with pytest.raises(ValueError, match="overflow"):
        encode_header(KIND_DATA, tag, [torch.zeros(1, 1, 1, 1)] * HEADER_LEN)


def test_link_options_are_checked():
    from dflash_prep.train.split.link import TapsReceiver, TapsSender

    with pytest.raises(ConfigError, match="--target-prefetch must be >= 1, got 0"):
        TapsSender({1: "drafter rank 0"}, prefetch=0)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--target-timeout must be a finite number"):
            TapsReceiver(0, timeout=bad)


def test_load_heads_reads_only_the_embedding_and_head_and_ties_them(tmp_path):
    from safetensors.torch import save_file

    from dflash_prep.train.split.taps import load_heads

    emb = torch.randn(11, 4)
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    save_file({"model.embed_tokens.weight": emb, "model.layers.0.mlp.weight": torch.zeros(2)},
              str(tmp_path / "model.safetensors"))
    e, h = load_heads(tmp_path, device=torch.device("cpu"))
    assert torch.equal(e.weight, emb) and h.weight is e.weight and not h.weight.requires_grad
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_heads(tmp_path, device=torch.device("cpu"))


# ----------------------------------------------------------------------------- spawned jobs
@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return build_pipeline(tmp_path_factory.mktemp("split"))


def _manifest_rows(paths: dict, rank: int, start: tuple[int, int], steps: int) -> list:
    """``[epoch, step, accum, sample ids]`` of drafter ``rank``'s rows, in manifest order."""
    src, rows, n = open_source(paths), [], 0
    for epoch in (0, 1):
        if epoch < start[0]:
            continue
        m = src.manifest(epoch)
        for s in range(start[1] if epoch == start[0] else 0, m.num_steps):
            if n == steps:
                return rows
            rows += [[epoch, mb.step, mb.accum, [int(x) for x in mb.sample_ids]]
                     for mb in m.microbatches(rank, s) if mb.step == s]
            n += 1
    return rows


def _job(tmp: Path, paths: dict, K: int, W: int, opts: dict, *, deadline: float = 150.0, kill=None) -> dict:
    """Spawn a K + W job; ``kill = (global rank, drafter rank whose progress triggers it, rows)``.
    Returns each rank's record plus ``exit``, ``killed_at`` and ``t_end``."""
    opts = {"K": K, "out": str(tmp), "prefetch": 2, "timeout": 30.0, **opts}
    ctx = mp.get_context("spawn")
    init = tmp / "init"
    procs = [ctx.Process(target=split_rank, args=(r, K + W, str(init), paths, opts)) for r in range(K + W)]
    for p in procs:
        p.start()
    def due():
        f = tmp / f"progress{kill[1] + K}"
        return kill[0] if f.exists() and f.read_text() and int(f.read_text()) >= kill[2] else None

    _, killed_at = supervise(procs, deadline=deadline, kill_check=due if kill else None)
    recs = {}
    for r, p in enumerate(procs):
        f = tmp / f"rank{r}.json"
        recs[r] = json.loads(f.read_text()) if f.exists() else {}
        recs[r]["exit"] = p.exitcode
    recs["killed_at"] = killed_at
    return recs


def _check_equal_and_ordered(paths, recs, K, W, steps, start=(0, 0)):
    for g in range(K + W):
        assert recs[g]["exit"] == 0, recs[g].get("trace")
    for i in range(W):
        r = recs[K + i]
        assert r["target"] == i % K
        want = _manifest_rows(paths, i, start, steps)
        assert r["seen"] == want, f"drafter {i} received rows out of manifest order"
        assert len(want) == steps * 2 and all(r["equal"]) and len(r["equal"]) == len(want)
        assert r["heads_equal"]
        assert r["group_ranks"] == list(range(W)) and r["group_total"] == sum(len(recs[K + j]["seen"]) for j in range(W))
    for k in range(K):
        t = recs[k]["timings"]
        steps_seen = sorted({(e, s) for e, s, _, _ in _manifest_rows(paths, 0, start, steps)})
        assert [(x["epoch"], x["step"]) for x in t] == steps_seen and steps_seen[-1][0] == 1  # crosses an epoch
        assert sum(x["messages"] for x in t) == steps * 2 * len(recs[k]["served"])
        assert all(x["bytes_sent"] > 0 and 1 <= x["in_flight_max"] <= 2 * len(recs[k]["served"]) for x in t)


@pytest.mark.timeout(240)
def test_one_target_rank_feeds_two_drafters_bit_identical_taps_in_manifest_order(pipe, tmp_path):
    """K = 1, W = 2, A = 2, across the epoch boundary: every micro-batch's taps equal a local
    FrozenTarget's on the same batch, bit for bit (fp32, CPU), in the drafter's manifest order."""
    recs = _job(tmp_path, pipe, 1, 2, {"steps": 4})
    _check_equal_and_ordered(pipe, recs, 1, 2, 4)
    assert recs[0]["served"] == [0, 1]


@pytest.mark.timeout(240)
def test_two_target_ranks_two_drafters_from_a_mid_epoch_cursor(pipe, tmp_path):
    """K = 2, W = 2, every rank starting at (epoch 0, step 1) as a resumed run does."""
    recs = _job(tmp_path, pipe, 2, 2, {"steps": 3, "start": [0, 1]})
    _check_equal_and_ordered(pipe, recs, 2, 2, 3, start=(0, 1))
    assert (recs[0]["served"], recs[1]["served"]) == ([0], [1])


@pytest.mark.timeout(240)
def test_a_forged_tag_stops_the_drafter_naming_both_tags(pipe, tmp_path):
    """Drafter 0 gets its first row's taps under step + 1, drafter 1 under a flipped digest."""
    recs = _job(tmp_path, pipe, 1, 2, {"steps": 1, "mode": "forge", "compare": False})
    assert recs[0]["exit"] == 0, recs[0].get("trace")
    src = open_source(pipe)
    for i in (0, 1):
        r = recs[1 + i]
        mb = next(src.manifest(0).microbatches(i))
        mine = str(Tag.of(0, mb.step, mb.accum, mb.sample_ids))
        assert r["exit"] == 1 and r["error_type"] == "FormatError"
        assert f"drafter rank {i}: target rank 0 sent the taps of {recs[0]['forged'][str(i)]}" in r["error"]
        assert f"this rank's manifest row is {mine}" in r["error"]
    assert "step 1 micro-batch 0" in recs[1]["error"] and "step 0 micro-batch 0" in recs[1]["error"]


@pytest.mark.timeout(240)
def test_a_silent_target_times_the_drafters_out_with_one_line(pipe, tmp_path):
    timeout = 4.0
    recs = _job(tmp_path, pipe, 1, 2, {"steps": 2, "timeout": timeout, "mode": "silent", "compare": False})
    assert recs[0]["exit"] == 0, recs[0].get("trace")
    for i in (0, 1):
        r = recs[1 + i]
        assert r["exit"] == 1 and r["error_type"] == "LinkError", r.get("trace")
        assert r["error"].startswith(f"drafter rank {i}: target rank 0 (global rank 0) sent nothing for epoch 0 step 0 "
                                     f"micro-batch 0 (sample-id digest ") and f"nothing within {timeout:g} s" in r["error"]
    assert recs[0]["t_end"] >= max(recs[1]["t_end"], recs[2]["t_end"]), "the target was alive throughout"


@pytest.mark.timeout(240)
def test_sigkill_of_the_target_stops_the_drafters_within_the_timeout(pipe, tmp_path):
    timeout = 15.0           # no healthy step of a loaded CI machine outlasts it (8 s once did, in the drafter-kill twin)
    recs = _job(tmp_path, pipe, 1, 2, {"steps": 6, "timeout": timeout, "drafter_sleep": 0.3, "compare": False},
                kill=(0, 0, 2))
    assert recs["killed_at"] is not None, {r: (recs[r].get("exit"), recs[r].get("error")) for r in range(3)}
    assert recs[0]["exit"] == -signal.SIGKILL
    for i in (0, 1):
        r = recs[1 + i]
        assert r["exit"] == 1 and r["error_type"] == "LinkError", r.get("trace")
        assert r["t_end"] - recs["killed_at"] < timeout + 5.0
        assert f"drafter rank {i}: target rank 0 (global rank 0) sent nothing for epoch " in r["error"]
        assert " step " in r["error"] and "\n" not in r["error"]


@pytest.mark.timeout(240)
def test_sigkill_of_a_drafter_stops_the_target_and_nothing_hangs(pipe, tmp_path):
    # long enough that no healthy step times out on a loaded machine before the kill (at 8 s a CI run
    # beside another job's engine lost a drafter to the link timeout before its second row, so the
    # kill never came); the bound below still fails a target that waits past it
    timeout = 20.0
    recs = _job(tmp_path, pipe, 1, 2, {"steps": 6, "timeout": timeout, "drafter_sleep": 0.3, "compare": False},
                kill=(2, 1, 2))
    assert recs["killed_at"] is not None, {r: (recs[r].get("exit"), recs[r].get("error")) for r in range(3)}
    assert recs[2]["exit"] == -signal.SIGKILL
    t = recs[0]
    assert t["exit"] == 1 and t["error_type"] == "LinkError", t.get("trace")
    assert "target rank 0: drafter rank 1 (global rank 2) did not take the taps of epoch " in t["error"]
    assert t["t_end"] - recs["killed_at"] < timeout + 5.0
    d0 = recs[1]   # the surviving drafter is told why its target stopped (or loses the connection)
    assert d0["exit"] == 1 and d0["error_type"] == "LinkError" and "target rank 0" in d0["error"]
    assert d0["t_end"] - recs["killed_at"] < 2 * timeout + 5.0

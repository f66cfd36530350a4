"""The online target's transport folder (dflash_prep/engine/states_stream.py): the space check
against the largest micro-batch, the fallback with its one line, the user's folder, and what a
killed run left, found by a new stream and by ``dflash-prep clean``. No engine: the stream's own
start is in tests/engine/test_engine_lifetime.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.engine.states_stream import (NPZ_SLACK, free_bytes, scratch_folder, stale_scratch,
                                              transport_bytes)
from dflash_prep.errors import ConfigError

MiB = 2 ** 20
# a Qwen3-8B-like plan: H = 4096, five taps in vLLM, five bf16 slots in the cache
PLAN = {"vllm_ids": [2, 10, 18, 26, 35], "hidden": 4096, "bytes_per_token": 5 * 4096 * 2}


def test_a_commands_bytes_are_its_input_one_engine_calls_spool_and_its_output():
    T = 16384
    big = transport_bytes(PLAN, T, 2000, batch_tokens=32768)      # the whole micro-batch in one engine call
    assert big == 4 * T + T * 5 * 4096 * 4 + T * 5 * 4096 * 2 + NPZ_SLACK
    assert 0.67e9 < T * PLAN["bytes_per_token"] < 0.68e9 and 2.0e9 < big < 2.02e9
    # one document a call: the spool holds the longest document's states only
    assert transport_bytes(PLAN, T, 2000, batch_tokens=1) == 4 * T + 2000 * 5 * 4096 * 4 + T * 5 * 4096 * 2 + NPZ_SLACK


def _shm_like(tmp_path: Path, free: int):
    """A stand-in for a container's /dev/shm: a real folder whose free space is ``free`` bytes."""
    shm = tmp_path / "shm"
    shm.mkdir()
    return shm, (lambda f: free if Path(f) == shm else free_bytes(f))


def test_shm_is_used_when_the_largest_micro_batch_fits(tmp_path):
    shm, free = _shm_like(tmp_path, 64 * MiB)
    assert scratch_folder(10 * MiB, chosen=None, fallbacks=[tmp_path / "out"], shm=shm, free=free) == (shm, None)


def test_a_64_mib_shm_falls_back_with_one_line_saying_why(tmp_path):
    shm, free = _shm_like(tmp_path, 64 * MiB)
    need = transport_bytes(PLAN, 4096, 2000, 32768)                # ~0.5 GB
    assert need < free_bytes(tmp_path), "this machine's disk cannot hold the test's micro-batch"
    folder, note = scratch_folder(need, chosen=None, fallbacks=[tmp_path / "tmp", tmp_path / "out"], shm=shm, free=free)
    assert folder == tmp_path / "tmp" and folder.is_dir()
    assert "\n" not in note and f"{shm} has 64.0 MiB free" in note and f"needs {need / MiB:,.1f} MiB" in note
    assert f"pass through {tmp_path / 'tmp'} instead" in note and "--engine-scratch" in note


def test_no_shm_at_all_falls_back_too(tmp_path):
    folder, note = scratch_folder(MiB, chosen=None, fallbacks=[tmp_path / "out"], shm=tmp_path / "no-shm")
    assert folder == tmp_path / "out" and f"{tmp_path / 'no-shm'} is not a writable folder" in note


def test_when_nothing_fits_the_run_is_refused_naming_each_folder(tmp_path):
    shm, _ = _shm_like(tmp_path, 0)
    need = free_bytes(tmp_path) * 4                               # more than the disk holds
    with pytest.raises(ConfigError) as e:
        scratch_folder(need, chosen=None, fallbacks=[tmp_path / "out"], shm=shm)
    msg = str(e.value)
    assert "\n" not in msg and f"{shm} has" in msg and f"{tmp_path / 'out'} has" in msg and "--engine-scratch" in msg


def test_the_users_folder_is_used_as_is_or_refused_when_too_small(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    shm, free = _shm_like(tmp_path, 64 * MiB)
    assert scratch_folder(MiB, chosen=mine, fallbacks=[], shm=shm, free=free) == (mine, None)
    with pytest.raises(ConfigError, match=rf"--engine-scratch {mine}: .* free, the largest micro-batch needs"):
        scratch_folder(free_bytes(mine) * 4, chosen=mine, fallbacks=[], shm=shm)
    with pytest.raises(ConfigError, match="not a writable folder"):
        scratch_folder(MiB, chosen=tmp_path / "missing", fallbacks=[], shm=shm)


def test_engine_scratch_is_an_online_target_flag():
    from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target

    target = str(tiny_target())
    assert dflash_cfg("o", target, target_engine="vllm", engine_scratch="/scratch").engine_scratch == "/scratch"
    with pytest.raises(ConfigError, match="--engine-scratch set up the target in vLLM.*add --target-engine vllm"):
        dflash_cfg("o", target, engine_scratch="/scratch")
    with pytest.raises(ConfigError, match="a cache has its own"):
        dflash_cfg("o", target, target_engine="vllm", states="c", engine_scratch="/scratch")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftovers(root: Path, pid: int) -> dict[str, Path]:
    host = socket.gethostname()
    made = {"dead": root / f"dflash-prep-states.{pid}.{host}.k1ll3d_x",
            "live": root / f"dflash-prep-states.{os.getpid()}.{host}.l1v3_abc",
            "other host": root / f"dflash-prep-states.{pid}.not-{host}.0th3rhst",
            "nested dead": root / "run" / "out" / f"dflash-prep-states.{pid}.{host}.n3st3d_x"}
    for p in made.values():
        (p / "spool").mkdir(parents=True)
        (p / "out-0.npz").write_bytes(b"x" * 1000)
    return made


def test_a_dead_runs_folder_is_found_and_a_live_or_foreign_one_is_not(tmp_path):
    made = _leftovers(tmp_path, _dead_pid())
    assert stale_scratch([tmp_path]) == [made["dead"]]
    assert stale_scratch([tmp_path], depth=3) == sorted([made["dead"], made["nested dead"]])


def test_clean_removes_what_a_killed_stream_left(tmp_path):
    """``dflash-prep clean PATH`` finds the leftovers in TMPDIR (and /dev/shm) and under PATH."""
    tmpdir, work = tmp_path / "tmpdir", tmp_path / "work"
    tmpdir.mkdir()
    pid = _dead_pid()
    in_tmp, in_work = _leftovers(tmpdir, pid), _leftovers(work, pid)
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    cmd = [sys.executable, "-m", "dflash_prep.cli", "clean", str(work)]
    r = subprocess.run(cmd + ["--dry-run"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for p in (in_tmp["dead"], in_work["dead"], in_work["nested dead"]):   # TMPDIR: its top level only
        assert f"would remove {p}" in r.stdout, r.stdout
    for made in (in_tmp, in_work):
        assert str(made["live"]) not in r.stdout and str(made["other host"]) not in r.stdout
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not in_tmp["dead"].exists() and not in_work["dead"].exists() and not in_work["nested dead"].exists()
    assert all(made[k].is_dir() for made in (in_tmp, in_work) for k in ("live", "other host"))


@pytest.mark.engine
def test_an_online_run_puts_its_transport_where_told_and_sizes_it_from_the_manifests(world, tmp_path):
    """A real run with ``--engine-scratch``: the states pass through that folder (nothing left there
    after the run), and the bytes it was checked for are the largest micro-batch's of the manifests."""
    import numpy as np

    from dflash_prep.engine.extract import ExtractConfig, plan_cache
    from dflash_prep.formats import manifest as manifest_mod
    from dflash_prep.objectives.target_taps import dflash_taps
    from dflash_prep.tests.engine.conftest import dflash_inputs
    from dflash_prep.train.config import build
    from dflash_prep.train.loop import train

    mine = tmp_path / "scratch"
    mine.mkdir()
    o = dflash_inputs(world, tmp_path)
    r = train(build(out=str(tmp_path / "run"), max_steps=2, draft_layers=1, target_engine="vllm",
                    engine_args=("dtype=float32",), engine_scratch=str(mine), **o))
    t = r["target_engine"]["transport"]
    m = manifest_mod.open(manifest_mod.find_epochs(o["manifests"])[0])
    T = int(m.table[:, manifest_mod.COL["real_tokens"]].max())
    p = plan_cache(ExtractConfig(data=world["data"], target=world["target"], out=tmp_path / "run", objective="dflash",
                                 target_layer_ids=tuple(dflash_taps(4, 1)), loss="ce", dtype="bf16"), None)
    assert t == {"folder": str(mine), "need_bytes": transport_bytes(p, T, int(np.max(m.sample_lens)), 32768)}, t
    assert list(mine.iterdir()) == []

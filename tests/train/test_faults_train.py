"""Fault injection on the trainer: checkpoints corrupted, token ids beyond the vocabulary,
a stop on error, SIGKILL mid-run then resume, a run folder that is not ours, and user
errors through the torchrun launcher as one line."""

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

from dflash_prep.errors import ConfigError, DflashError, FormatError
from dflash_prep.formats import dataset as ds_mod
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.fileio import atomic_save_npy, fingerprint_array, fingerprint_json
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.train import checkpoint as ckpt
from dflash_prep.train.config import TrainConfig, build as build_config
from dflash_prep.train.loop import train
from dflash_prep.verify import verify_dataset

REPO = Path(__file__).resolve().parents[2]
SMALL = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
VOCAB = 50


def write_dataset(folder: Path, samples: list[np.ndarray], *, vocab: int = VOCAB) -> None:
    """A dataset folder through the format's own writer (ShardWriter + write_meta)."""
    folder.mkdir(parents=True)
    lens = np.array([len(s) for s in samples], np.int32)
    key = "k" * 32
    w = ds_mod.ShardWriter(folder, 2000, key)
    for i in range(0, len(samples), 8):
        chunk = samples[i:i + 8]
        ids = np.concatenate(chunk).astype(np.int32)
        mask = (np.arange(len(ids)) % 3 != 0).astype(np.uint8)
        w.add(ids, mask, lens[i:i + 8], np.arange(i, i + len(chunk), dtype=np.int64))
    shards = w.finish()
    atomic_save_npy(folder / ds_mod.LENGTHS_FILE, lens)
    lfp = fingerprint_array(lens)
    ds_mod.write_meta(folder, {
        "fingerprint": fingerprint_json({"inputs": key, "lengths": lfp}), "inputs_fingerprint": key,
        "tokenizer": {"vocab_size": vocab, "pad_id": 0, "eos_id": 1, "bos_id": None, "name": "test", "fingerprint": "t"},
        "counts": {"samples": len(samples)}, "tokens": {"total": int(lens.sum())},
        "lengths": {"file": ds_mod.LENGTHS_FILE, "dtype": "int32", "fingerprint": lfp}, "shards": shards})


def _samples(seed: int = 0, n: int = 48) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=int(rng.integers(8, 60))).astype(np.int32) for _ in range(n)]


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfaults")
    write_dataset(root / "data", _samples())
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(30,), budget=plan_mod.Budget(value=160)), root / "plan")
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0, 1], out=root / "man")
    return root


def _cfg(root: Path, out: Path, **kw) -> TrainConfig:
    base = dict(data=str(root / "data"), plan=str(root / "plan" / "plan.json"), manifests=str(root / "man"),
                out=str(out), model="tiny", model_overrides=SMALL, progress=False, prefetch=2, device="cpu",
                warmup_steps=1, lr=1e-2, pack_missing=False)
    base.update(kw)
    return build_config(**base)


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["global_step"] for x in (out / "log.jsonl").read_text().splitlines()[1:]]


@pytest.fixture(scope="module")
def trained(pipe):
    train(_cfg(pipe, pipe / "run", max_steps=3))
    return pipe / "run" / ckpt.CKPT_FILE


@pytest.mark.parametrize("fault", ["flip-start", "flip-middle", "flip-tensor", "flip-trailer", "truncate", "empty"])
def test_corrupt_checkpoint_is_refused(trained, tmp_path, fault):
    p = tmp_path / ckpt.CKPT_FILE
    raw = bytearray(trained.read_bytes())
    if fault.startswith("flip"):
        pos = {"start": 3, "middle": len(raw) // 2, "tensor": len(raw) - 400, "trailer": len(raw) - 20}[fault[5:]]
        raw[pos] ^= 0xFF
    else:
        raw = raw[: len(raw) // 2] if fault == "truncate" else bytearray()
    p.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=ckpt.CKPT_FILE) as ei:
        ckpt.load(p)
    assert "--from-scratch" in str(ei.value)


def test_checkpoint_from_another_run_is_refused(pipe, trained, tmp_path):
    other = tmp_path / "other"
    src = lengths_mod.load(data=pipe / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(20,), budget=plan_mod.Budget(value=160)), other)
    pack_epochs(plan=other / "plan.json", epochs=[0, 1], out=other / "man")
    out = tmp_path / "run"
    out.mkdir()
    for name in (ckpt.CKPT_FILE, "log.jsonl"):
        (out / name).write_bytes((trained.parent / name).read_bytes())
    with pytest.raises(DflashError, match="refusing to resume"):
        train(_cfg(pipe, out, plan=str(other / "plan.json"), manifests=str(other / "man"), max_steps=4))


def _bad_sample_at_step(pipe: Path, tmp_path: Path, step: int) -> Path:
    """A copy of the pipeline whose dataset has one token id >= vocab in a sample of ``step``."""
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(pipe, root, ignore=shutil.ignore_patterns("run*"))
    m = manifest.open(root / "man" / "epoch-0000")
    sid = int(m.microbatch(step).sample_ids[0])
    samples = _samples()
    samples[sid] = samples[sid].copy()
    samples[sid][1] = VOCAB + 7
    shutil.rmtree(root / "data")
    write_dataset(root / "data", samples)        # same lengths: plan and manifests still match
    return root, sid


def test_token_id_beyond_vocab_names_shard_and_sample_and_keeps_progress(pipe, tmp_path):
    root, sid = _bad_sample_at_step(pipe, tmp_path, 3)
    with pytest.raises(FormatError) as ei:
        verify_dataset(root / "data")
    assert "shard-0000" in str(ei.value) and f"sample {sid}" in str(ei.value) and "vocabulary" in str(ei.value)
    out = tmp_path / "run"
    with pytest.raises(FormatError) as ei:
        train(_cfg(root, out, max_steps=6))
    msg = str(ei.value)
    assert ".arrow" in msg and f"sample {sid}" in msg and "vocabulary of 50" in msg
    # the stop on error saved the three whole steps before it
    state = ckpt.load(out / ckpt.CKPT_FILE)
    assert state["cursor"] == {"epoch": 0, "step": 3, "global_step": 3}
    assert _steps(out) == [1, 2, 3]


def test_resume_drops_log_records_past_the_checkpoint(pipe, tmp_path):
    out = tmp_path / "run"
    train(_cfg(pipe, out, max_steps=3))
    with open(out / "log.jsonl", "a") as f:   # what a run killed after its last checkpoint leaves
        f.write(json.dumps({"epoch": 0, "step": 3, "global_step": 4, "loss": 1.0}) + "\n")
        f.write('{"epoch": 0, "step": 4, "glo')
    s = train(_cfg(pipe, out, max_steps=5))
    assert s["global_step"] == 5 and _steps(out) == [1, 2, 3, 4, 5]
    text = (out / "log.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_a_kill_mid_run_then_resume_logs_each_step_once(pipe, tmp_path, sig):
    """SIGKILL, or SIGINT (Ctrl-C: one line, exit 130, no traceback), at a random point after the first
    checkpoint; the rerun resumes from a whole checkpoint and logs each step once."""
    out = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    cfg.write_text("[model]\npreset = \"tiny\"\n" + "".join(f"{k} = {v}\n" for k, v in SMALL.items()))
    env = dict(os.environ, PYTHONPATH=str(REPO), NUMBA_CACHE_DIR=str(REPO / ".numba_cache"))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_prep.train", "--config", str(cfg), "--data",
                             str(pipe / "data"), "--plan", str(pipe / "plan" / "plan.json"), "--manifests",
                             str(pipe / "man"), "--out", str(out), "--device", "cpu", "--epochs", "2",
                             "--ckpt-every", "1", "--no-progress", "--no-pack-missing"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None and not (out / ckpt.CKPT_FILE).exists():
        time.sleep(0.01)
    time.sleep(float(np.random.default_rng(3).uniform(0.0, 0.4)))
    proc.send_signal(sig)
    rc = proc.wait()
    err = proc.stderr.read().decode()
    if sig == signal.SIGINT and rc != 0:              # a run that had already finished exits 0
        assert rc == 130 and "interrupted (rank 0)" in err and "Traceback" not in err, (rc, err[-2000:])
    state = ckpt.load(out / ckpt.CKPT_FILE)           # whatever the kill hit, the checkpoint is whole
    done = int(state["cursor"]["global_step"])
    total = sum(manifest.open(manifest.epoch_dir(pipe / "man", e)).num_steps for e in (0, 1))
    s = train(_cfg(pipe, out, epochs=2))
    assert s["global_step"] == total and s["steps"] == total - done
    assert _steps(out) == list(range(1, total + 1))


def test_run_folder_with_a_users_files_is_refused(pipe, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "log.jsonl").write_text("my own notes\n")
    with pytest.raises(ConfigError, match="log.jsonl"):
        train(_cfg(pipe, out, max_steps=1))
    assert (out / "log.jsonl").read_text() == "my own notes\n"
    for bad in ({"lr": float("inf")}, {"grad_clip": float("nan")}):
        with pytest.raises(ConfigError):
            _cfg(pipe, out, **bad)


def test_user_error_through_the_torchrun_launcher_is_one_line(pipe, tmp_path, capfd, monkeypatch):
    """torchrun's own code, run in-process by the launcher; the worker is a real subprocess."""
    from dflash_prep.train import launch

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    rc = launch.main(["--standalone", "--nproc_per_node", "1", "-m", "dflash_prep.train", "--data", str(pipe / "data"),
                      "--plan", str(tmp_path / "nope.json"), "--manifests", str(pipe / "man"),
                      "--out", str(tmp_path / "r"), "--device", "cpu"])
    err = capfd.readouterr().err.strip()
    assert rc == 1 and "Traceback" not in err and "ChildFailedError" not in err, err
    assert len(err.splitlines()) == 1 and "nope.json" in err and "dflash-prep analyze" in err, err


def test_sample_ids_out_of_range_are_one_clear_error(pipe, tmp_path):
    import shutil

    root = tmp_path / "oor"
    shutil.copytree(pipe, root, ignore=shutil.ignore_patterns("run*"))
    d = root / "man" / "epoch-0000"
    m = manifest.open(d)
    arrays = {k: np.array(v) for k, v in m.arrays.items()}
    first = int(m.table[0, manifest.COL["start"]])   # the first sample of step 0
    arrays["sample_ids"][first] = 10_000              # beyond the 48 samples, with consistent hashes
    header = {k: v for k, v in m.header.items() if k not in ("arrays", "fingerprint", "format", "version")}
    manifest.write(d, header, arrays, overwrite=True)
    with pytest.raises(DflashError, match="outside"):
        from dflash_prep.verify import verify_epoch

        verify_epoch(d)
    with pytest.raises(DflashError, match="sample id 10000 is out of range"):
        train(_cfg(root, tmp_path / "run", max_steps=2))

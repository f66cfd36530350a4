"""Fault injection on the data stages: every artifact corrupted, kills, two writers, data loss.

For each on-disk artifact (shard, lengths, meta, plan, manifest arrays and header, root):
flip a byte, truncate, delete, edit each header field, swap folders; the loaders and
``verify`` must refuse each with a message naming the file, or (for a byte the loader
never reads) return exactly the original data. Then SIGKILL of tokenize and pack at
random points, two writers at once, and every data-loss case of issue 12.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_prep.errors import ConfigError, DflashError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest, outputs
from dflash_prep.formats import plan as plan_mod
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.verify import verify_dataset, verify_epoch

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), NUMBA_CACHE_DIR=str(REPO / ".numba_cache"))
    return subprocess.Popen([sys.executable, "-m", "dflash_prep.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    synth(SynthConfig(out=root / "corpus", n=60, seed=1))
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", max_len=400,
                            shard_mb=0.02, chunk_rows=8))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(200,), budget=plan_mod.Budget(value=1600), seed=0),
                  root / "plan")
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0, 1], out=root / "man", world_size=2)
    return root


@pytest.fixture
def p(pipe, tmp_path):
    dst = tmp_path / "p"
    shutil.copytree(pipe, dst)
    return dst


def _flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos % len(raw)] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _refused(fn, name: str) -> str:
    with pytest.raises(DflashError) as ei:
        fn()
    msg = str(ei.value)
    assert name in msg, f"message does not name {name}: {msg}"
    assert "\n" not in msg or "refusing" in msg
    return msg


def _read_all(data: Path) -> list:
    ds = open_dataset(data)
    return [tuple(a.tolist() for a in ds.sample(i)) for i in range(len(ds))]


def _token_offset(shard: Path) -> int:
    """Byte offset of the first record batch's input_ids values inside the shard file."""
    import pyarrow as pa

    with pa.memory_map(str(shard)) as mm:
        b = next(iter(pa.ipc.open_stream(mm)))
        raw = bytes(memoryview(b.column("input_ids").values.buffers()[1])[:64])
    return shard.read_bytes().find(raw)


# ----------------------------------------------------------------------------- dataset
@pytest.mark.parametrize("where", ["tokens", 0, 97, 701, 1500, -9])
def test_shard_flipped_byte(p, pipe, where):
    shard = p / "data" / "shard-00001.arrow"
    pos = _token_offset(shard) + 5 if where == "tokens" else where
    _flip(shard, pos)
    _refused(lambda: verify_dataset(p / "data"), "shard-00001")
    try:
        got = _read_all(p / "data")
    except DflashError as e:                      # the loader refuses, naming the shard ...
        assert "shard-00001" in str(e)
        assert where != "tokens" or "digest" in str(e) or "vocabulary" in str(e)
        return
    assert where != "tokens"                      # ... or the byte was one it never reads
    assert got == _read_all(pipe / "data")


@pytest.mark.parametrize("fault", ["truncate", "delete", "swap"])
def test_shard_truncated_deleted_swapped(p, fault):
    a, b = p / "data" / "shard-00000.arrow", p / "data" / "shard-00001.arrow"
    if fault == "truncate":
        _truncate(a)
    elif fault == "delete":
        a.unlink()
    else:
        tmp = a.with_suffix(".x")
        a.rename(tmp), b.rename(a), tmp.rename(b)
    _refused(lambda: open_dataset(p / "data"), "shard-0000")
    _refused(lambda: verify_dataset(p / "data"), "shard-0000")


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("name", ["lengths.npy", "meta.json"])
def test_lengths_and_meta_corrupt(p, name, fault):
    f = p / "data" / name
    {"flip": lambda: _flip(f, f.stat().st_size - 3), "truncate": lambda: _truncate(f), "delete": f.unlink}[fault]()
    _refused(lambda: open_dataset(p / "data"), name)
    _refused(lambda: lengths_mod.load(data=p / "data"), name)   # what analyze and pack read


def _edited(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, str):
        return v + "0"
    if isinstance(v, list):
        return v[:-1] if v else [0]
    if isinstance(v, dict):
        return {**v, "edited": 1}
    return 0


META_KEYS = ["fingerprint", "inputs_fingerprint", "created_by", "tokenizer", "options", "counts", "tokens",
             "skipped_examples", "lengths", "shards", "source", "meta_fingerprint"]


@pytest.mark.parametrize("key", META_KEYS)
@pytest.mark.parametrize("how", ["edit", "remove"])
def test_meta_each_field(p, key, how):
    f = p / "data" / "meta.json"
    d = json.loads(f.read_text())
    assert key in d
    if how == "edit":
        d[key] = _edited(d[key])
    else:
        del d[key]
    f.write_text(json.dumps(d))
    _refused(lambda: open_dataset(p / "data"), "meta.json")


def test_dataset_folder_swapped_for_another_run(p, tmp_path):
    other = tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus" / "chat.jsonl"),), out=tmp_path / "other", max_len=300,
                                    shard_mb=0.02, chunk_rows=8))
    shutil.rmtree(p / "data")
    shutil.copytree(tmp_path / "other", p / "data")
    assert other["fingerprint"] != json.loads((p / "man" / "epoch-0000" / "manifest.json").read_text())["data"]["fingerprint"]
    _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[2], out=p / "man"), "analyze")
    _refused(lambda: verify_epoch(p / "man" / "epoch-0000"), "epoch-0000")


# ----------------------------------------------------------------------------- plan
PLAN_KEYS = ["data", "boundaries", "budget", "seed", "window", "buckets", "predicted", "fingerprint",
             "file_fingerprint"]


@pytest.mark.parametrize("fault", ["flip", "truncate", "delete"] + [f"edit:{k}" for k in PLAN_KEYS])
def test_plan_refused(p, fault):
    f = p / "plan" / "plan.json"
    if fault.startswith("edit:"):
        d = json.loads(f.read_text())
        d[fault[5:]] = _edited(d[fault[5:]])
        f.write_text(json.dumps(d))
    else:
        {"flip": lambda: _flip(f, f.stat().st_size // 2), "truncate": lambda: _truncate(f), "delete": f.unlink}[fault]()
    _refused(lambda: plan_mod.load(f), "plan.json")


# ----------------------------------------------------------------------------- manifests
ARRAYS = ["microbatches", "sample_ids", "sample_lens", "dropped_ids"]


@pytest.mark.parametrize("fault", ["flip-data", "flip-header", "truncate", "delete"])
@pytest.mark.parametrize("name", ARRAYS)
def test_manifest_array_refused(p, name, fault):
    f = p / "man" / "epoch-0001" / f"{name}.npy"
    if name == "dropped_ids" and fault == "flip-data":   # empty without --drop-last: no data byte to flip
        fault = "flip-header"
    {"flip-data": lambda: _flip(f, f.stat().st_size - 2), "flip-header": lambda: _flip(f, 20),
     "truncate": lambda: _truncate(f), "delete": f.unlink}[fault]()
    _refused(lambda: manifest.open(p / "man" / "epoch-0001"), f"{name}.npy" if fault != "delete" else "epoch-0001")
    _refused(lambda: verify_epoch(p / "man" / "epoch-0001"), "epoch-0001")


HEADER_KEYS = ["epoch", "layout", "world_size", "grad_accum", "num_steps", "num_microbatches", "num_samples_used",
               "budget", "options", "plan_fingerprint", "data", "inputs_fingerprint", "columns", "arrays",
               "run_fingerprint", "fingerprint"]


@pytest.mark.parametrize("key", HEADER_KEYS + ["summary", "flip", "truncate", "delete"])
def test_manifest_header_refused(p, key):
    d = p / "man" / "epoch-0001"
    f = d / "manifest.json"
    h = json.loads(f.read_text())
    if key == "summary":
        h["summary"]["step_mix"] += 0.01
        f.write_text(json.dumps(h))
        manifest.open(d)  # the summary is only reporting: the loader does not use it ...
        _refused(lambda: verify_epoch(d), "step_mix")   # ... and verify recomputes it
        return
    if key in h:
        h[key] = _edited(h[key])
        f.write_text(json.dumps(h))
    else:
        {"flip": lambda: _flip(f, f.stat().st_size // 3), "truncate": lambda: _truncate(f), "delete": f.unlink}[key]()
    _refused(lambda: manifest.open(d), "epoch-0001")
    _refused(lambda: verify_epoch(d), "epoch-0001")


def test_epoch_folders_swapped_or_from_another_root(p, tmp_path):
    man = p / "man"
    tmp = man / "x"
    (man / "epoch-0000").rename(tmp), (man / "epoch-0001").rename(man / "epoch-0000"), tmp.rename(man / "epoch-0001")
    _refused(lambda: manifest.open(man / "epoch-0000"), "epoch-0000")
    _refused(lambda: verify_epoch(man / "epoch-0001"), "epoch-0001")
    # an epoch of another pack run (other world size) dropped into this root
    other = pack_epochs(plan=p / "plan" / "plan.json", epochs=[2], out=tmp_path / "o", world_size=1)[0]
    shutil.copytree(other, man / "epoch-0002")
    _refused(lambda: manifest.open(man / "epoch-0002"), "another run")


def test_root_json_edited_or_deleted(p):
    f = p / "man" / manifest.ROOT_FILE
    d = json.loads(f.read_text())
    d["run"]["config"]["world_size"] = 4
    f.write_text(json.dumps(d))
    _refused(lambda: manifest.open(p / "man" / "epoch-0000"), "root.json")
    f.unlink()
    _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[2], out=p / "man", world_size=2), "root.json")


# ----------------------------------------------------------------------------- kills
def _kill_during_write(args, cwd: Path, where: Path, seed: int) -> bool:
    """Start the CLI, wait until its first temp output appears under ``where``, then SIGKILL
    it after a random 0-300 ms (seeded): a kill in the middle of writing. Returns whether
    the process was still running when killed."""
    rng = np.random.default_rng(seed)
    proc = _cli(*args, cwd=cwd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if where.is_dir() and any(outputs.is_temp_name(q.name) and not q.name.endswith(".lock")
                                  for q in where.iterdir()):
            break
        time.sleep(0.01)
    time.sleep(float(rng.uniform(0, 0.3)))
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return alive


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_tokenize_leaves_nothing_and_rerun_succeeds(p, seed):
    _kill_during_write(["tokenize", "corpus/chat.jsonl", "--tokenizer", "byte", "--out", "fresh", "--max-len", "400", "--shard-mb", "0.02"],
                       p, p, seed)
    fresh = p / "fresh"
    if fresh.exists():            # the kill came after the rename: then it is complete
        assert len(open_dataset(fresh)) == 60
    meta = tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus" / "chat.jsonl"),), out=fresh, max_len=400, shard_mb=0.02))
    assert len(_read_all(fresh)) == 60 and meta["counts"]["samples"] == 60
    assert not [q for q in p.iterdir() if outputs.is_temp_name(q.name)], "debris of the killed run was not reclaimed"


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_pack_leaves_no_partial_epoch(p, seed):
    _kill_during_write(["pack", "data", "--plan", "plan/plan.json", "--out", "m2", "--epochs", "0-7",
                        "--world-size", "2"], p, p / "m2", seed)
    for d in sorted((p / "m2").glob("epoch-*")) if (p / "m2").exists() else []:
        verify_epoch(d)           # every visible epoch is complete
    dirs = pack_epochs(plan=p / "plan" / "plan.json", epochs=range(8), out=p / "m2", world_size=2)
    assert [verify_epoch(d)["microbatches"] > 0 for d in dirs] == [True] * 8
    assert not [q for q in (p / "m2").iterdir() if outputs.is_temp_name(q.name)]


# ----------------------------------------------------------------------------- two writers
def test_second_writer_fails_clearly_while_the_first_holds_the_lock(p):
    held, release = threading.Event(), threading.Event()

    def first():
        with outputs.lock(p / "man", inside=True):
            held.set()
            release.wait(10)

    t = threading.Thread(target=first)
    t.start()
    held.wait(10)
    try:
        _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[2], out=p / "man", world_size=2),
                 "being written by another")
        _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus" / "chat.jsonl"),), out=p / "man")),
                 "being written by another")
    finally:
        release.set()
        t.join()
    pack_epochs(plan=p / "plan" / "plan.json", epochs=[2], out=p / "man", world_size=2)  # free again


def test_two_pack_processes_never_mix_a_root(p):
    a = _cli("pack", "data", "--plan", "plan/plan.json", "--out", "m3", "--epochs", "0-3", "--world-size", "2", cwd=p)
    b = _cli("pack", "data", "--plan", "plan/plan.json", "--out", "m3", "--epochs", "0-3", "--world-size", "1",
             "--overwrite", cwd=p)
    outs = [(proc.wait(), proc.stderr.read().decode()) for proc in (a, b)]
    for rc, err in outs:
        assert rc == 0 or "being written by another" in err or "another pack run" in err, err
        assert "Traceback" not in err
    runs = {manifest.read_header(d)["run_fingerprint"] for d in (p / "m3").glob("epoch-*")}
    assert runs == {manifest.read_root(p / "m3")["run_fingerprint"]}     # one run only
    for d in manifest.find_epochs(p / "m3"):
        verify_epoch(d)


# ----------------------------------------------------------------------------- data loss
def _untouched(folder: Path, before: dict) -> None:
    assert {str(q.relative_to(folder)): q.read_bytes() for q in folder.rglob("*") if q.is_file()} == before


def _snapshot(folder: Path) -> dict:
    return {str(q.relative_to(folder)): q.read_bytes() for q in folder.rglob("*") if q.is_file()}


def test_overwrite_never_deletes_inputs_user_folders_or_the_cwd(p, monkeypatch):
    corpus = _snapshot(p / "corpus")
    for out in (p / "corpus", p):   # the input folder itself, and a folder holding it
        _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=out, overwrite=True)), "input")
    _untouched(p / "corpus", corpus)
    user = p / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=user, overwrite=True)), "mine")
    _refused(lambda: synth(SynthConfig(out=user, n=3, overwrite=True)), "mine")
    assert (user / "notes.txt").read_text() == "mine"
    monkeypatch.chdir(user)
    _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=Path("."), overwrite=True)),
             "working directory")
    (p / "afile").write_text("x")
    _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=p / "afile")), "afile")
    assert (p / "afile").read_text() == "x"


def test_pack_never_replaces_a_users_epoch_folder(p):
    (p / "root").mkdir()
    (p / "root" / "epoch-0000").mkdir()
    (p / "root" / "epoch-0000" / "keep.txt").write_text("mine")
    for ow in (False, True):
        _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[0], out=p / "root", overwrite=ow),
                 "root")
    assert (p / "root" / "epoch-0000" / "keep.txt").read_text() == "mine"
    _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[0], out=p / "data"), "input")
    # inside a root of ours, an unmarked epoch folder is refused even with --overwrite
    (p / "man" / "epoch-0003").mkdir()
    (p / "man" / "epoch-0003" / "keep.txt").write_text("mine")
    _refused(lambda: pack_epochs(plan=p / "plan" / "plan.json", epochs=[3], out=p / "man", world_size=2,
                                 overwrite=True), "epoch-0003")
    assert (p / "man" / "epoch-0003" / "keep.txt").read_text() == "mine"


def test_analyze_never_overwrites_a_users_file(p):
    from dflash_prep.analyze.analyze import AnalyzeConfig, run

    out = p / "an"
    out.mkdir()
    for name in ("plan.json", "analyze-report.json", "analyze.png"):
        (out / name).write_text("user data")
        _refused(lambda: run(AnalyzeConfig(data=p / "data", out=out, budget=1600, window=0, plot=True)), name)
        assert (out / name).read_text() == "user data"
        (out / name).unlink()
    run(AnalyzeConfig(data=p / "data", out=out, budget=1600, window=0, plot=False))
    run(AnalyzeConfig(data=p / "data", out=out, budget=1600, window=0, plot=False))   # same plan: rewritten
    _refused(lambda: run(AnalyzeConfig(data=p / "data", out=out, budget=2000, window=0, plot=False)), "--overwrite")
    run(AnalyzeConfig(data=p / "data", out=out, budget=2000, window=0, plot=False, overwrite=True))


def test_paths_resolve_relative_to_the_recording_file(p, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere"
    shutil.move(str(p), str(moved))        # the whole tree moves; recorded paths still resolve
    monkeypatch.chdir(tmp_path)
    assert plan_mod.load(moved / "plan" / "plan.json").data["path"].endswith("data")
    verify_epoch(moved / "man" / "epoch-0001")
    pack_epochs(plan=moved / "plan" / "plan.json", epochs=[2], out=moved / "man", world_size=2)


def test_killed_swap_restores_the_previous_version(p):
    # a kill between the two renames of a swap leaves only .NAME.old-PID: the next writer puts it back
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    before = _snapshot(p / "data")
    os.replace(p / "data", p / f".data.old-{int(dead.stdout)}")
    with outputs.lock(p / "data"):     # what every writer of data takes first
        pass
    _untouched(p / "data", before)
    assert not list(p.glob(".data.old-*"))


def test_clean_lists_and_removes_debris_of_killed_runs(p, tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    junk = [p / f".data.{dead}.abcd1234.tmp", p / "man" / f".epoch-0005.{dead}.abcd_123.tmp"]
    for j in junk:
        j.mkdir()
        (j / "big.bin").write_bytes(b"0" * 1000)
    live = p / f".data.{os.getpid()}.live1234.tmp"
    live.mkdir()
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    out = CliRunner().invoke(app, ["clean", str(p), "--dry-run"]).output
    assert all(str(j) in out for j in junk) and str(live) not in out
    assert all(j.exists() for j in junk)
    assert CliRunner().invoke(app, ["clean", str(p)]).exit_code == 0
    assert not any(j.exists() for j in junk) and live.exists()


def test_strict_json_and_finite_options(p):
    from dflash_prep.formats.fileio import atomic_write_json, read_json

    with pytest.raises(DflashError, match="a.b"):
        atomic_write_json(p / "x.json", {"a": {"b": float("nan")}}, format="dflash-prep/t", version=1)
    (p / "y.json").write_text('{"format": "dflash-prep/t", "version": 1, "v": NaN}')
    _refused(lambda: read_json(p / "y.json", format="dflash-prep/t"), "y.json")
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ConfigError):
            plan_mod.Budget(value=bad)
        with pytest.raises(ConfigError):
            TokenizeConfig(tokenizer="byte", inputs=("x",), out=p / "z", shard_mb=bad)


def test_bad_inputs_are_one_line_errors(p, monkeypatch):
    """Non-UTF-8, deep nesting, a FIFO, /dev/zero, non-finite floats, a file as --out: exit 1, one line, no traceback."""
    (p / "bad.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (p / "deep.jsonl").write_text('{"messages": ' + "[" * 5000 + "]" * 5000 + "}\n")
    os.mkfifo(p / "fifo.jsonl")
    cases = [(["tokenize", "bad.jsonl", "--tokenizer", "byte", "--out", "o1"], "bad.jsonl:1"),
             (["tokenize", "deep.jsonl", "--tokenizer", "byte", "--out", "o2"], "deep.jsonl:1"),
             (["tokenize", "fifo.jsonl", "--tokenizer", "byte", "--out", "o3"], "FIFO"),
             (["tokenize", "/dev/zero", "--tokenizer", "byte", "--out", "o4"], "/dev/zero"),
             (["tokenize", "corpus", "--tokenizer", "byte", "--out", "o5", "--shard-mb", "inf"], "--shard-mb"),
             (["analyze", "data", "--out", "o6", "--budget", "nan"], "budget"),
             (["pack", "data", "--plan", "plan/plan.json", "--out", "corpus/chat.jsonl", "--epoch", "0"], "chat.jsonl"),
             (["verify", "man", "--lengths", "corpus/chat.jsonl"], "chat.jsonl")]
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    monkeypatch.chdir(p)
    for args, want in cases:     # in-process: the same CLI code, without 8 interpreter start-ups
        r = CliRunner().invoke(app, args)
        err = r.stderr
        assert r.exit_code == 1 and "Traceback" not in err and want in err, (want, err, r.exception)
        assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("field", ["format", "version", "first_id", "inputs"])
def test_shard_header_each_field(p, field):
    """A shard rewritten with one header field edited, and meta.json made to match its bytes: still refused."""
    import pyarrow as pa

    from dflash_prep.formats.dataset import read_meta, write_meta
    from dflash_prep.formats.fileio import fingerprint_file

    data = p / "data"
    shard = data / "shard-00001.arrow"
    reader = pa.ipc.open_stream(pa.BufferReader(shard.read_bytes()))   # in memory: the file is rewritten below
    schema, batches = reader.schema, list(reader)
    head = json.loads(schema.metadata[b"dflash-prep"])
    head[field] = _edited(head[field])
    schema = schema.with_metadata({**schema.metadata, b"dflash-prep": json.dumps(head).encode()})
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for b in batches:
            w.write_batch(pa.record_batch(b.columns, schema=schema))
    meta = {k: v for k, v in read_meta(data).items() if k not in ("format", "version")}
    sh = next(s for s in meta["shards"] if s["file"] == shard.name)
    sh.update(file_bytes=shard.stat().st_size, sha256=fingerprint_file(shard))
    write_meta(data, meta)
    _refused(lambda: open_dataset(data), "shard-00001")

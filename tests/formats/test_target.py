"""A target folder's config and identity (dflash_prep/formats/target.py).

The digest cache: a cached fingerprint equals the uncached one; a rewritten weight file (same size,
new bytes; also with its old mtime put back) is re-hashed; a cache that does not parse is ignored and
rewritten; a read-only target folder leaves its digests in the per-user cache and gets nothing
written into it; ranks starting together leave one whole cache.

The shared config reader: an empty ``config.json`` (``{}``) is refused in one line, naming the file
and every missing key, by each entry point that reads a target's config: ``extract``, ``analyze``/``pack
--target-config``, ``evaluate`` and the trainer (dflash, dflash2, eagle3), before any engine starts.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.formats import target as tgt

OLD = time.time() - 3600          # weights are old: a file modified within RACY_S is hashed, never cached


class _NoTemplate:
    chat_template = None


def _folder(root: Path, sizes=(3 << 20, 1 << 20)) -> Path:
    """config.json, weight files of ``sizes`` random bytes and a tokenizer file, all an hour old."""
    d = root / "target"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    for i, n in enumerate(sizes):
        (d / f"model-{i:05d}.safetensors").write_bytes(os.urandom(n))
    (d / "tokenizer.json").write_text("{}")
    for f in d.iterdir():
        os.utime(f, (OLD, OLD))
    return d


def _by_hand(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _ident(d: Path, **kw) -> dict:
    return tgt.target_identity(d, _NoTemplate(), **kw)


@pytest.fixture
def hashed(monkeypatch):
    """The files each real hash reads (a cache hit reads none)."""
    calls: list[list[str]] = []
    real = tgt._hash_files
    monkeypatch.setattr(tgt, "_hash_files", lambda files: calls.append([f.name for f in files]) or real(files))
    return calls


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _weights(d: Path) -> list[Path]:
    return [d / "config.json", *sorted(d.glob("*.safetensors"))]


def test_the_cached_fingerprint_is_the_uncached_one(tmp_path, hashed):
    d = _folder(tmp_path)
    want = _by_hand(_weights(d))
    first = _ident(d)
    assert first["target_fingerprint"] == want == _ident(d, cache=False)["target_fingerprint"]
    assert first["tokenizer_hash"] == _by_hand([d / "tokenizer.json"])
    cache = json.loads((d / tgt.DIGEST_CACHE).read_text())
    assert (cache["format"], cache["version"]) == (tgt.DIGEST_FORMAT, tgt.DIGEST_VERSION)
    assert sorted(os.listdir(d)) == sorted([tgt.DIGEST_CACHE, "config.json", "model-00000.safetensors",
                                            "model-00001.safetensors", "tokenizer.json"])    # that file, nothing else
    hashed.clear()
    assert _ident(d) == first and hashed == []                 # the second start reads no weight byte
    assert not (tmp_path / "xdg").exists()


@pytest.mark.parametrize("old_mtime", [False, True], ids=["new-mtime", "mtime-put-back"])
def test_a_rewritten_weight_file_is_rehashed(tmp_path, hashed, old_mtime):
    d = _folder(tmp_path)
    before = _ident(d)["target_fingerprint"]
    w = d / "model-00001.safetensors"
    size, ino = w.stat().st_size, w.stat().st_ino
    with open(w, "r+b") as f:                                  # in place: same size, same inode, new bytes
        f.seek(size // 2)
        f.write(b"\x7f" * 64)
    if old_mtime:
        os.utime(w, (OLD, OLD))                                # only ctime still tells
    assert (w.stat().st_size, w.stat().st_ino) == (size, ino)
    hashed.clear()
    after = _ident(d)["target_fingerprint"]
    assert after != before and after == _by_hand(_weights(d))
    assert [c for c in hashed if "model-00001.safetensors" in c], hashed


def test_a_file_modified_just_now_is_hashed_but_not_cached(tmp_path, hashed):
    d = _folder(tmp_path)
    (d / "model-00000.safetensors").write_bytes(os.urandom(1024))     # its mtime is now: may still be moving
    first = _ident(d)["target_fingerprint"]
    hashed.clear()
    assert _ident(d)["target_fingerprint"] == first == _by_hand(_weights(d))
    assert any("model-00000.safetensors" in c for c in hashed)


@pytest.mark.parametrize("garbage", [b"\x00\xffnot json{", b'{"format": "dflash-prep/target-digests", "version": 99, '
                                     b'"entries": {}}', b'[1, 2]', b'{"format": "dflash-prep/target-digests", '
                                     b'"version": 1, "entries": {"config.json": "x"}}',
                                     b'{"format": "dflash-prep/target-digests", "version": 1, "entries": {"k": '
                                     b'{"files": [], "sha256": "' + b"0" * 64 + b'", "written_ns": "soon"}}}'],
                         ids=["bytes", "version", "list", "entries", "written"])
def test_a_cache_that_does_not_parse_is_ignored_and_rewritten(tmp_path, hashed, garbage):
    d = _folder(tmp_path)
    (d / tgt.DIGEST_CACHE).write_bytes(garbage)
    assert _ident(d)["target_fingerprint"] == _by_hand(_weights(d))
    assert hashed, "a garbage cache must not be trusted"
    cache = json.loads((d / tgt.DIGEST_CACHE).read_text())
    assert cache["version"] == tgt.DIGEST_VERSION and len(cache["entries"]) == 2     # weights, tokenizer


def test_a_forged_entry_for_other_stats_is_not_used(tmp_path):
    """An entry is a hit only for the exact (name, size, mtime_ns, ctime_ns, inode, device) of every file."""
    d = _folder(tmp_path)
    _ident(d)
    cache = json.loads((d / tgt.DIGEST_CACHE).read_text())
    (key,) = [k for k, e in cache["entries"].items() if e["files"][0][0] == "config.json"]
    forged = cache["entries"].pop(key)
    forged["sha256"] = "0" * 64
    forged["files"][1][2] += 1                                  # another mtime, under the real key
    cache["entries"][key] = forged
    (d / tgt.DIGEST_CACHE).write_text(json.dumps(cache))
    assert _ident(d)["target_fingerprint"] == _by_hand(_weights(d))


def test_another_machines_view_of_a_shared_folder_is_kept(tmp_path, hashed):
    """A shared filesystem gives each client its own device number: an entry of another mount stays
    beside ours (they do not evict each other at every start), and never answers for ours."""
    d = _folder(tmp_path)
    first = _ident(d)["target_fingerprint"]
    cache = json.loads((d / tgt.DIGEST_CACHE).read_text())
    (mine,) = [e for e in cache["entries"].values() if e["files"][0][0] == "config.json"]
    other = json.loads(json.dumps(mine))
    for f in other["files"]:
        f[5] += 1                                               # the same files seen through another device
    other["sha256"] = "1" * 64
    key = hashlib.sha256(json.dumps(other["files"]).encode()).hexdigest()
    cache["entries"] = {key: other}                             # the other machine wrote last, alone
    (d / tgt.DIGEST_CACHE).write_text(json.dumps(cache))
    hashed.clear()
    assert _ident(d)["target_fingerprint"] == first and hashed      # its entry is not ours: re-hashed
    entries = json.loads((d / tgt.DIGEST_CACHE).read_text())["entries"]
    assert entries[key] == other and len(entries) == 3          # theirs kept, ours (weights, tokenizer) added
    hashed.clear()
    assert _ident(d)["target_fingerprint"] == first and hashed == []


def _read_only(d: Path) -> bool:
    if os.geteuid() != 0:
        d.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0


def _writable(d: Path) -> None:
    if os.geteuid() != 0:
        d.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(d)], capture_output=True)


def test_a_read_only_target_folder_uses_the_user_cache(tmp_path, hashed):
    d = _folder(tmp_path)
    listing = sorted(os.listdir(d))
    if not _read_only(d):
        pytest.skip("cannot make a folder read-only for root here (chattr +i)")
    try:
        assert not os.access(d, os.W_OK)
        first = _ident(d)
        assert first["target_fingerprint"] == _by_hand(_weights(d)) and sorted(os.listdir(d)) == listing
        (user,) = (tmp_path / "xdg" / "dflash-prep" / "target-digests").iterdir()
        assert json.loads(user.read_text())["format"] == tgt.DIGEST_FORMAT
        hashed.clear()
        assert _ident(d) == first and hashed == []
    finally:
        _writable(d)


def _rank(d: str, q) -> None:
    q.put(tgt.target_identity(d, _NoTemplate())["target_fingerprint"])


def test_ranks_starting_together_leave_one_whole_cache(tmp_path):
    d = _folder(tmp_path, sizes=(8 << 20,))
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(d), q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert set(got) == {_by_hand(_weights(d))}
    cache = json.loads((d / tgt.DIGEST_CACHE).read_text())
    assert len(cache["entries"]) == 2 and not [f for f in os.listdir(d) if f.endswith(".tmp")]
    assert tgt._read_cache(d / tgt.DIGEST_CACHE) == cache["entries"]


# --- the shared config reader --------------------------------------------------------------------------------------

def test_read_target_config_names_every_missing_key(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{}")
    with pytest.raises(ConfigError) as ei:
        tgt.read_target_config(tmp_path)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: no model_type, hidden_size, num_hidden_layers, num_attention_heads, "
                          "intermediate_size, vocab_size") and "\n" not in msg, msg
    p.write_text(json.dumps({"model_type": "llava", "text_config": {"hidden_size": 64, "num_hidden_layers": "4",
                                                                    "num_attention_heads": 4, "vocab_size": 0}}))
    with pytest.raises(ConfigError, match=r"no intermediate_size; not positive integers: num_hidden_layers='4', "
                                          r"vocab_size=0"):
        tgt.read_target_config(p)
    full = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 96,
            "vocab_size": 300}
    p.write_text(json.dumps({"model_type": "llava", "text_config": full}))
    assert tgt.read_target_config(p) == full
    p.write_text(json.dumps(full))
    assert tgt.read_target_config(p, model_type=False) == full
    with pytest.raises(ConfigError, match="no model_type"):
        tgt.read_target_config(p)
    p.write_text("[]")
    with pytest.raises(ConfigError, match="is a JSON list, not an object"):
        tgt.read_target_config(p)


@pytest.fixture(scope="module")
def empty(tmp_path_factory):
    """A real tiny target copied with ``config.json`` = ``{}``, data tokenized with its tokenizer,
    a plan and one epoch packed for one rank."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.pack.pack import pack_epochs
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    from dflash_prep.tests.train.dflash_fixtures import tiny_target

    root = tmp_path_factory.mktemp("empty-config")
    good = tiny_target()
    shutil.copytree(good, root / "target")
    (root / "target" / "config.json").write_text("{}")
    synth(SynthConfig(out=root / "corpus", n=24, seed=1))
    tokenize(TokenizeConfig(tokenizer=str(good), inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data",
                            max_len=400))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(200,), budget=plan_mod.Budget(value=1600), seed=0),
                  root / "plan")
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man", world_size=1)
    (root / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (root / "export").mkdir()
    (root / "export" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": 4,
                                                              "dflash_config": {}}))
    return root


KEYS = "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size"


def _one_line(r) -> None:
    err = r.stderr
    assert r.exit_code == 1 and "Traceback" not in err, (r.exit_code, err, r.exception)
    (line,) = err.strip().splitlines()
    assert "target/config.json: no " in line and KEYS in line, line


@pytest.mark.parametrize("args", [
    ["extract", "data", "--target", "target", "--out", "states", "--objective", "dflash"],
    ["extract", "data", "--target", "target", "--out", "states", "--objective", "eagle3"],
    ["pack", "data", "--plan", "plan/plan.json", "--epochs", "0", "--world-size", "1", "--out", "man2",
     "--objective", "dflash", "--target-config", "target"],
    ["analyze", "data", "--budget", "1600", "--out", "plan2", "--objective", "eagle3", "--target-config", "target"],
    ["evaluate", "--target", "target", "--export", "export", "--prompts", "prompts.jsonl", "--out", "eval.json"],
], ids=["extract-dflash", "extract-eagle3", "pack", "analyze", "evaluate"])
def test_an_empty_target_config_is_refused_in_one_line_by_the_cli(empty, monkeypatch, args):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    monkeypatch.chdir(empty)
    monkeypatch.setenv("DFLASH_PREP_VLLM_PYTHON", "/nonexistent")      # no engine may be needed to refuse it
    _one_line(CliRunner().invoke(app, args))
    assert not (empty / "states").exists() and not (empty / "eval.json").exists()


@pytest.mark.parametrize("objective", ["dflash", "dflash2"])
def test_an_empty_target_config_is_refused_in_one_line_by_the_trainer(empty, monkeypatch, tmp_path, objective):
    from typer.testing import CliRunner

    from dflash_prep.train.__main__ import app as train_app

    monkeypatch.chdir(empty)
    for engine in (["--target-engine", "hf"], ["--target-engine", "vllm"]):
        r = CliRunner().invoke(train_app, ["--objective", objective, "--target", "target", "--data", "data",
                                           "--manifests", "man", "--plan", "plan/plan.json", "--max-steps", "1",
                                           "--device", "cpu", "--out", str(tmp_path / "run"), *engine])
        _one_line(r)


def test_an_empty_target_config_is_refused_by_the_eagle3_trainer(empty):
    import torch

    from dflash_prep.train.objectives import build_objective
    from dflash_prep.train.objectives.eagle3.objective import plan

    from dflash_prep.tests.train.eagle3_fixtures import eagle3_cfg, eagle3_source

    src = eagle3_source()
    cfg = eagle3_cfg("unused", empty / "target")
    for build in (lambda: build_objective(cfg, src.dataset, torch.device("cpu"), manifest=src.manifest(0)),
                  lambda: plan(cfg, src.manifest(0))):        # a drafter rank, a split job's target rank
        with pytest.raises(ConfigError, match=r"target/config.json: no model_type, hidden_size, num_hidden_layers"):
            build()


def test_the_cache_is_no_part_of_a_folders_own_revision(tmp_path):
    """regenerate names a local model by a fingerprint of its small files: the digest cache and a
    temp a kill left are not the model's."""
    from dflash_prep.regenerate.engines import target_revision

    d = _folder(tmp_path)
    before = target_revision(d)
    _ident(d)
    (d / f".{tgt.DIGEST_CACHE}.999999.abcd1234.tmp").write_text("{")
    assert (d / tgt.DIGEST_CACHE).is_file() and target_revision(d) == before
    (d / "generation_config.json").write_text("{}")
    assert target_revision(d) != before


def test_the_digest_bench_times_a_real_hash_and_a_cached_lookup(tmp_path):
    """``bench/hash_cost.py --target-gb`` on 20 MB: the first start hashes and writes the cache, a
    later one only reads it (docs/reliability.md#target-identity has the 4 GB numbers)."""
    from dflash_prep.bench.hash_cost import target_digest

    r = target_digest(0.02, tmp_path)
    assert r["weight_bytes"] == 20_000_000 and r["first_hash_s"] > 0 and r["uncached_rehash_page_cache_s"] > 0
    assert r["cached_lookup_s"] < r["uncached_rehash_page_cache_s"], r

"""tokenize --engine ray on a local 2-CPU Ray: byte-identical to --engine local, same errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError, InputError
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

from dflash_prep.tests.assets.fixtures import CHATS, train_bpe, write_jsonl

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def run(tmp_path: Path, inputs, name, **kw) -> dict:
    kw.setdefault("tokenizer", "byte")
    return tokenize(TokenizeConfig(inputs=tuple(str(i) for i in inputs), out=tmp_path / name, **kw))


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def corpus(tmp_path: Path) -> list[Path]:
    """Two files (two sources), chat records of several lengths, one with a bad record to skip."""
    rows = [{"id": f"r{i}", "messages": CHATS[i % 3][: 2 + (i % 2)]} for i in range(41)]
    rows[17] = {"messages": [{"role": "user", "content": "no answer"}, {"role": "nobody", "content": "x"}]}
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": c} for c in CHATS * 5])
    return [a, b]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_ray_output_is_byte_identical_to_local(tmp_path, local_ray, tokenizer):
    tok = "byte" if tokenizer == "byte" else str(train_bpe(tmp_path / "bpe"))
    inputs = corpus(tmp_path)
    # small chunks and shards: many tasks in flight out of order, several shards
    kw = dict(tokenizer=tok, chunk_rows=3, shard_mb=0.002, on_error="skip")
    local = run(tmp_path, inputs, "local", num_proc=1, **kw)
    remote = run(tmp_path, inputs, "ray", engine="ray", **kw)
    assert len(local["shards"]) > 2 and local["counts"]["skipped"] >= 1 and local["skipped_examples"]
    assert remote["fingerprint"] == local["fingerprint"]
    a, b = files(tmp_path / "local"), files(tmp_path / "ray")
    assert sorted(a) == sorted(b) and len(a) > 5
    for name in a:
        assert a[name] == b[name], name
    # the engine is not in the fingerprint: the local folder is up to date for the Ray engine
    again = tokenize(TokenizeConfig(inputs=tuple(map(str, inputs)), out=tmp_path / "local", engine="ray", **kw))
    assert again["up_to_date"]


def test_ray_bad_record_fails_like_local(tmp_path, local_ray):
    rows = [{"messages": CHATS[0]}] * 10 + ['{"messages": [{"role": "user", "content": 3}]}']
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(InputError) as local:
        run(tmp_path, [f], "local", chunk_rows=4)
    with pytest.raises(InputError) as remote:
        run(tmp_path, [f], "ray", chunk_rows=4, engine="ray")
    assert str(remote.value) == str(local.value) and "bad.jsonl:11" in str(remote.value)
    assert not (tmp_path / "ray").exists()


def test_missing_ray_names_the_extra(tmp_path, monkeypatch):
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHATS[0]}])
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dflash-prep\[ray\]'"):
        run(tmp_path, [f], "out", engine="ray")
    with pytest.raises(ConfigError, match="--engine"):
        TokenizeConfig(inputs=(str(f),), out=tmp_path / "x", tokenizer="byte", engine="spark")

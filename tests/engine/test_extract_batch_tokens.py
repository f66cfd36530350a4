"""``extract --node-rank i --num-nodes N``: the nodes of one build agree on ``--batch-tokens`` (the
engine's calls are formed from it, and vLLM's kernels are not batch-invariant), so a node started
with another value is refused in one line before its engine starts, and the value is recorded in
``states.json`` and in the command it advises. Run in this process with the stand-in engine
(:mod:`.fake_states_worker`), so no vLLM is needed."""

from __future__ import annotations

import shlex
import sys

import pytest

from dflash_prep.engine.extract import ExtractConfig, extract
from dflash_prep.errors import FingerprintMismatch
from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_write_json

from dflash_prep.tests.train.dflash_fixtures import tiny_target


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny target and 40 chats tokenized with it."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    root = tmp_path_factory.mktemp("batch-tokens")
    target = tiny_target()
    synth(SynthConfig(out=root / "corpus", profile="mini", n=40, seed=1))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=256, on_overflow="drop"))
    return {"target": target, "data": root / "data"}


@pytest.fixture
def fake_engine(monkeypatch):
    from dflash_prep.engine.backends import base

    from dflash_prep.tests.engine.fake_states_worker import FAKE

    monkeypatch.setitem(base.REGISTRY.entries, FAKE.name, FAKE)
    return FAKE.name


def _node(data, out, engine: str, **kw) -> dict:
    cfg = ExtractConfig(data=data["data"], target=data["target"], out=out, objective="dflash", draft_layers=1,
                        dtype="fp32", shard_mb=0.1, timeout_s=120.0, engine=engine, python=sys.executable, **kw)
    return extract(cfg, progress=False)


def test_a_node_of_another_batch_tokens_is_refused_in_one_line(data, fake_engine, tmp_path):
    out = tmp_path / "cache"
    first = _node(data, out, fake_engine, batch_tokens=64, node_rank=0, num_nodes=2)
    assert not first["complete"] and first["shards_written"] >= 1, first
    header = (out / fmt.HEADER_FILE).read_bytes()
    with pytest.raises(FingerprintMismatch) as e:
        _node(data, out, fake_engine, node_rank=1, num_nodes=2)            # the default, 32768
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"{out} is being built with --batch-tokens 64 (" in msg and "node 1 of 2 was started with --batch-tokens " \
           "32768" in msg and "start node 1 with --batch-tokens 64" in msg, msg
    assert (out / fmt.HEADER_FILE).read_bytes() == header and not (out / "extract.node-1-of-2.log").exists(), \
        "the refused node touched the header or started its engine"
    h = fmt.read_header(out)
    assert h["batch_tokens"] == 64 and shlex.split(h["command"])[-2:] == ["--batch-tokens", "64"], h["command"]
    done = _node(data, out, fake_engine, batch_tokens=64, node_rank=1, num_nodes=2)
    assert done["complete"], done
    fmt.verify_states(out)


def test_a_header_of_an_older_build_records_no_batch_tokens_and_is_not_compared(data, fake_engine, tmp_path):
    out = tmp_path / "cache"
    _node(data, out, fake_engine, batch_tokens=64, node_rank=0, num_nodes=2)
    old = {k: v for k, v in fmt.read_header(out).items() if k != "batch_tokens"}
    atomic_write_json(out / fmt.HEADER_FILE, old, format=fmt.FORMAT, version=fmt.VERSION)
    assert _node(data, out, fake_engine, node_rank=1, num_nodes=2)["complete"]

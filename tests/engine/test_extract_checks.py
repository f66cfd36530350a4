"""What ``dflash-prep extract`` and the trainer refuse before any engine starts (fast: no vLLM
needed): data tokenized for another model than the target (another vocabulary, another chat
template), each in one line naming both identities and the ``dflash-prep tokenize`` command that
fixes it. The real-engine checks of a build are in test_extract.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dflash_prep.errors import FingerprintMismatch
from dflash_prep.formats import states as fmt

from dflash_prep.tests.train.dflash_fixtures import tiny_target


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """The same chats tokenized four ways: with the target, with the byte tokenizer, with a copy of
    the target whose chat template differs, and with that copy plus an explicit --chat-template."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    root = tmp_path_factory.mktemp("tokcheck")
    target = tiny_target()
    other = root / "other-target"
    shutil.copytree(target, other)
    tmpl = other / "chat_template.jinja"
    tmpl.write_text(tmpl.read_text() + "{# another model's template #}\n")
    (root / "chatml.jinja").write_text(tmpl.read_text())
    synth(SynthConfig(out=root / "corpus", profile="mini", n=8, seed=0))
    chats = (str(root / "corpus" / "chat.jsonl"),)
    out = {"target": target, "other": other, "root": root}
    for name, kw in (("same", dict(tokenizer=str(target))), ("byte", dict(tokenizer="byte")),
                     ("template", dict(tokenizer=str(other))),
                     ("explicit", dict(tokenizer=str(target), chat_template=str(root / "chatml.jinja")))):
        tokenize(TokenizeConfig(inputs=chats, out=root / name, max_len=256, on_overflow="drop", **kw))
        out[name] = root / name
    return out


def _cfg(data, target, out, **kw):
    from dflash_prep.engine.extract import ExtractConfig

    return ExtractConfig(data=data, target=target, out=out, python="/nonexistent/python", draft_layers=1, **kw)


def test_extract_refuses_another_tokenizers_data_before_the_engine(datasets, tmp_path):
    """The byte tokenizer's data with a BPE target (issue 40: it built 6.9M tokens of meaningless
    states): refused by the library before the engine's python is even looked at, and by the CLI
    in one line with no traceback."""
    from dflash_prep.engine.extract import extract

    target = datasets["target"]
    with pytest.raises(FingerprintMismatch) as e:
        extract(_cfg(datasets["byte"], target, tmp_path / "c"), progress=False)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert f"{datasets['byte']} was tokenized for another model (another vocabulary)" in msg, msg
    assert "with the built-in byte tokenizer (no tokenizer files; chat template " in msg, msg
    assert f"the target has {target} (tokenizer.json " in msg, msg
    assert f"`dflash-prep tokenize INPUTS --tokenizer {target} --out NEW_DATA`) and extract from it" in msg, msg
    assert not (tmp_path / "c" / fmt.HEADER_FILE).exists()
    env = {**os.environ, "DFLASH_PREP_VLLM_PYTHON": "/nonexistent/python"}
    r = subprocess.run([sys.executable, "-m", "dflash_prep.cli", "extract", str(datasets["byte"]), "--target",
                        str(target), "--objective", "dflash", "--draft-layers", "1", "--out", str(tmp_path / "c2")],
                       capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "was tokenized for another model (another vocabulary)" in lines[0] and "Traceback" not in r.stderr


def test_another_chat_template_is_refused_an_explicit_one_passes(datasets, tmp_path):
    """The same vocabulary rendered with another model's template is another model's data; a
    template the user chose with ``tokenize --chat-template`` is recorded as such and passes."""
    from dflash_prep.engine.extract import extract
    from dflash_prep.tokenize.identity import check_tokenizer
    from dflash_prep.formats.dataset import read_meta

    target = datasets["target"]
    with pytest.raises(FingerprintMismatch) as e:
        extract(_cfg(datasets["template"], target, tmp_path / "c"), progress=False)
    msg = str(e.value)
    theirs = read_meta(datasets["template"])["tokenizer"]["chat_template"]["sha256"][:12]
    ours = read_meta(datasets["same"])["tokenizer"]["chat_template"]["sha256"][:12]
    assert theirs != ours
    assert "(another chat template)" in msg, msg
    assert f"chat template {theirs})" in msg and f"chat template {ours})" in msg, msg
    for name in ("same", "explicit"):
        check_tokenizer(datasets[name], read_meta(datasets[name]), target, then="")
    # data of the target's own tokenizer goes on to the engine: here the missing python says so
    from dflash_prep.errors import EngineError

    with pytest.raises(EngineError, match="/nonexistent/python"):
        extract(_cfg(datasets["same"], target, tmp_path / "c3"), progress=False)


def test_the_trainer_refuses_another_tokenizers_data(datasets, tmp_path):
    """A drafter run on data tokenized for another model is refused at its target's setup, for
    every target engine (here the transformers target and a states cache)."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.train.loop import train
    from dflash_prep.train.source import FileSource

    from dflash_prep.tests.train.dflash_fixtures import dflash_cfg

    root = tmp_path
    data = datasets["byte"]
    src = lengths_mod.load(data=data)
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=2048), seed=0),
                  root / "plan")
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man", data=data,
                config=PackConfig(world_size=1, layout="varlen"))
    source = FileSource(data, root / "plan" / "plan.json", root / "man", pack_missing=False)
    for kw in ({}, dict(target_engine="vllm", states=str(root / "no-cache-needed"))):
        with pytest.raises(FingerprintMismatch) as e:
            train(dflash_cfg(root / "run", datasets["target"], max_steps=1, **kw), source=source)
        msg = str(e.value)
        assert "\n" not in msg and f"{data} was tokenized for another model (another vocabulary)" in msg, msg
        assert msg.endswith(", then analyze and pack it for this run"), msg

"""The export's ``dflash_prep`` block read back: training_mode, mode_warnings and resolve_thinking
on export folders with hand-written config.json files (no torch, no engine)."""

from __future__ import annotations

import json

import pytest

from dflash_prep.engine.serving_mode import (BLOCK_KEY, COST, export_block, mode_warnings, resolve_thinking,
                                             training_mode)
from dflash_prep.errors import ConfigError, FormatError

SHA = "1f" * 32
OTHER = "2e" * 32


def _export(tmp_path, name: str, thinking: str | None, sha: str | None = SHA, **block):
    """An export folder whose config.json has the block (``thinking`` None: an export from before it)."""
    d = tmp_path / name
    d.mkdir()
    c = {"architectures": ["DFlashDraftModel"], "block_size": 4, "dflash_config": {"mask_token_id": 1}}
    if thinking is not None:
        c[BLOCK_KEY] = {**export_block(serving={"thinking": thinking, "source": "records (regenerate --reasoning)",
                                                "chat_template_sha256": sha},
                                       dataset_fingerprint="d" * 32, recipe={"objective": "dflash"}), **block}
    (d / "config.json").write_text(json.dumps(c))
    return d


def test_training_mode_reads_the_block_or_none(tmp_path):
    b = training_mode(_export(tmp_path, "a", "on"))
    assert b == {"version": 1, "thinking": "on", "thinking_source": "records (regenerate --reasoning)",
                 "chat_template_sha256": SHA, "dataset_fingerprint": "d" * 32, "recipe": {"objective": "dflash"}}
    assert training_mode(_export(tmp_path, "old", None)) is None
    with pytest.raises(FormatError, match="config.json: not found"):
        training_mode(tmp_path / "nothing")
    with pytest.raises(FormatError, match="version 2, this dflash-prep reads 1"):
        training_mode(_export(tmp_path, "new", "on", version=2))


def test_matching_mode_and_template_warn_nothing(tmp_path):
    for mode in ("on", "off"):
        d = _export(tmp_path, mode, mode)
        assert mode_warnings(export_dir=d, requested=mode, template_sha=SHA) == []


@pytest.mark.parametrize("trained, requested", [("on", "off"), ("off", "on"), ("off", "default")])
def test_a_mode_mismatch_is_one_line_with_its_cost_and_the_matching_flag(tmp_path, trained, requested):
    (line,) = mode_warnings(export_dir=_export(tmp_path, "x", trained), requested=requested, template_sha=SHA)
    assert "\n" not in line and COST in line and line.endswith(f"pass --thinking {trained}")
    assert f"trained on data made with thinking {trained}" in line


@pytest.mark.parametrize("target_sha", [OTHER, None])
def test_a_template_mismatch_names_the_fix(tmp_path, target_sha):
    (line,) = mode_warnings(export_dir=_export(tmp_path, "x", "on"), requested="on", template_sha=target_sha)
    assert "chat template" in line and SHA[:12] in line and (target_sha or "none")[:12] in line
    assert "evaluate with the target the drafter was trained on" in line
    both = mode_warnings(export_dir=_export(tmp_path, "y", "on"), requested="off", template_sha=target_sha)
    assert len(both) == 2


def test_no_template_hash_recorded_is_not_compared(tmp_path):
    assert mode_warnings(export_dir=_export(tmp_path, "x", "on", sha=None), requested="on", template_sha=OTHER) == []


@pytest.mark.parametrize("trained", ["unknown", "mixed", None])
def test_unknown_or_mixed_training_mode(tmp_path, trained):
    d = _export(tmp_path, "x", trained)
    (line,) = mode_warnings(export_dir=d, requested="default", template_sha=SHA)
    assert "auto cannot decide" in line and "template's default" in line
    # an explicit mode cannot be compared with an unknown one: nothing to say about it
    assert mode_warnings(export_dir=d, requested="on", template_sha=SHA) == []
    assert resolve_thinking("auto", [d])[0] is None


def test_bad_requested_value_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="requested must be on, off or default"):
        mode_warnings(export_dir=_export(tmp_path, "x", "on"), requested="auto", template_sha=SHA)


def test_resolve_thinking_flags(tmp_path):
    on, off = _export(tmp_path, "on", "on"), _export(tmp_path, "off", "off")
    assert resolve_thinking("on", [off])[0] is True and resolve_thinking("off", [on])[0] is False
    assert "enable_thinking=true" in resolve_thinking("on", [])[1]
    assert resolve_thinking("auto", [on]) == (True, "--thinking auto: thinking on, the mode the drafter was "
                                                    "trained in; enable_thinking=true sent to the chat template")
    value, why = resolve_thinking("auto", [off, _export(tmp_path, "old", None)])
    assert value is False and "old: no training mode recorded" in why
    assert resolve_thinking("auto", [])[0] is None
    with pytest.raises(ConfigError, match=r"different modes \(on: on, off: off\); pass --thinking on or "
                                          r"--thinking off") as e:
        resolve_thinking("auto", [on, off])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--thinking must be one of on, off, auto"):
        resolve_thinking("yes", [on])

"""Objective options declared once: the flags, cli_flags and the header section derive from the fields."""

from __future__ import annotations

import shlex
import typing

import pytest

from dflash_prep.errors import ConfigError
from dflash_prep.objectives import anchors, options
from dflash_prep.objectives.dflash import DrafterOptions, drafter_options
from dflash_prep.objectives.drafter_cost import DrafterCostModel

DIMS = "hidden=64,layers=4,intermediate=96,heads=4,kv_heads=2,head_dim=16,vocab=300"


def _parse(cls, command: str, line: str) -> dict:
    """``{flag name: value}`` of a flag string, typed as the declaration says (a click stand-in)."""
    by_spelling = {fl.spelling: fl for fl in options.flags(cls, command)}
    words, out = shlex.split(line), {}
    while words:
        fl = by_spelling[words.pop(0)]
        if fl.type is bool:
            out[fl.name] = True
            continue
        t = next((a for a in typing.get_args(fl.type) if a is not type(None)), fl.type)
        out[fl.name] = t(words.pop(0))
    return out


@pytest.mark.parametrize("kw", [
    {},
    {"block_size": 8, "max_anchors": 24, "anchor_policy": "density", "anchor_budget": 900, "cost_fill": 0.5,
     "anchor_seed": 11, "store_anchors": True},
    {"cost_fill": 0.0, "draft_layers": 2, "sliding_window": 0},
])
def test_cli_flags_rebuild_the_options(kw):
    o = drafter_options(target_dims=DIMS, **kw)
    line = options.to_flags(o, options.PACK)
    assert options.from_flags(DrafterOptions, options.PACK, _parse(DrafterOptions, options.PACK, line)) == o
    assert ("--store-anchors" in line) == bool(kw.get("store_anchors")) and "--target-config" not in line


def test_each_command_takes_its_declared_flags_with_one_default_source():
    pack = {fl.name: fl for fl in options.flags(DrafterOptions, options.PACK)}
    analyze = {fl.name for fl in options.flags(DrafterOptions, options.ANALYZE)}
    assert set(pack) - analyze == {"anchor_budget", "cost_fill", "anchor_seed", "store_anchors"}
    assert pack["block_size"].default == anchors.DEFAULT_BLOCK_SIZE == DrafterOptions().block_size
    assert pack["max_anchors"].default == anchors.DEFAULT_MAX_ANCHORS
    assert pack["target_dims"].metavar == "SIZES" and pack["store_anchors"].type is bool
    built = options.from_flags(DrafterOptions, options.ANALYZE, {"target_dims": DIMS, "cost_fill": 0.1})
    assert built.cost_fill == DrafterOptions().cost_fill      # not an analyze flag: its default stays
    assert built.cost_model == DrafterCostModel.from_dims(DIMS, pack["draft_layers"].default,
                                                          pack["sliding_window"].default)


def test_header_section_round_trips():
    o = drafter_options(target_dims=DIMS, block_size=8, max_anchors=24, anchor_seed=3)
    h = options.header(o)
    assert h == {"block_size": 8, "max_anchors": 24, "anchor_policy": "cap", "anchor_seed": 3}
    assert options.from_header(DrafterOptions, h, cost_model=o.cost_model) == o
    with pytest.raises(ConfigError, match="anchor_seed"):
        options.from_header(DrafterOptions, {k: v for k, v in h.items() if k != "anchor_seed"})


def test_the_cost_model_needs_exactly_one_source_and_unknown_names_are_refused():
    with pytest.raises(ConfigError, match="exactly one"):
        drafter_options(block_size=8)
    with pytest.raises(ConfigError, match="unknown drafter option"):
        drafter_options(target_dims=DIMS, block=8)
    with pytest.raises(TypeError, match="go together"):
        options.option(1, help="x", flags=(options.Flag("a", int, 1, "a"),))


def test_a_declared_panel_reaches_pack_help():
    """A field may name its own --help panel; the CLI otherwise groups an objective's flags."""
    from dataclasses import dataclass

    from typer.testing import CliRunner

    from dflash_prep import objectives
    from dflash_prep.cli import app
    from dflash_prep.objectives.base import _REGISTRY

    @dataclass(frozen=True)
    class PanelOptions:
        knob: int = options.option(3, commands=(options.PACK,), flag="panel_knob", panel="Knobs", help="a knob")

        @classmethod
        def from_json(cls, d):
            return cls(**d)

    class PanelObjective(objectives.DataObjective):
        name = "panel-test"
        options_type = PanelOptions

    objectives.register(PanelObjective())
    try:
        out = CliRunner().invoke(app, ["pack", "--help"], env={"COLUMNS": "200"}).output
    finally:
        del _REGISTRY["panel-test"]
    assert "Knobs" in out and "--panel-knob" in out and "Objective panel-test" not in out


@pytest.mark.parametrize("command", ["pack", "analyze"])
def test_another_objectives_flag_is_refused_not_ignored(tmp_path, command):
    """``pack --block-size 8`` under the default ``--objective lm`` used to pack an LM epoch and
    drop the flag; a flag set for an objective that is not the one chosen is a usage error naming it."""
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    args = [command, str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    args += ["--plan", str(tmp_path / "plan.json"), "--epoch", "0"] if command == "pack" else []
    res = CliRunner().invoke(app, args + ["--block-size", "8"])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.replace("│", " ").split())
    assert "--block-size is an option of --objective dflash" in text and "--objective lm" in text, text
    assert not (tmp_path / "out").exists()

"""Fault injection, issue 24: what a hostile-input run still found after tests/test_faults.py.

verify on epochs it cannot fully check (a missing manifest.json, an epoch-looking folder that
is not one, each summary field edited); ``--out`` through a symbolic link, for every command
that writes a folder; a corrupt ``.npy`` header in every reader; a malformed field of a
tokenizer folder; seeds outside the 64 bits that key the RNG; and the role header of a
conversation that opens with an assistant turn.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from .test_faults import _refused, _snapshot, p, pipe  # noqa: F401  (fixtures)
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats import plan as plan_mod
from dflash_prep.analyze.analyze import AnalyzeConfig
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.errors import ConfigError, DflashError, InputError
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep import verify as verify_mod
from dflash_prep.verify import verify_epoch, verify_path


def _cli(args: list[str], cwd: Path):
    """The CLI in-process, from ``cwd``: (exit code, stderr)."""
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, args)
    finally:
        os.chdir(old)
    return r.exit_code, r.stderr


def _one_line_error(args: list[str], cwd: Path, want: str) -> str:
    rc, err = _cli(args, cwd)
    assert rc == 1 and "Traceback" not in err and want in err, (args, rc, err)
    assert len(err.strip().splitlines()) == 1, err
    return err


# ----------------------------------------------------------------------------- 1. verify
def test_verify_refuses_an_epoch_folder_without_its_manifest(p):
    (p / "man" / "epoch-0000" / "manifest.json").unlink()
    _refused(lambda: verify_path(p / "man"), "epoch-0000")             # the root: named, not skipped
    _refused(lambda: verify_path(p / "man" / "epoch-0000"), "epoch-0000")
    _one_line_error(["verify", "man", "--data", "data"], p, "epoch-0000")


@pytest.mark.parametrize("entry", ["epoch-7", "epoch-0003", "epoch-0004.bak", "epoch-file"])
def test_verify_names_every_folder_that_looks_like_an_epoch(p, entry):
    target = p / "man" / entry
    if entry == "epoch-file":
        target.write_text("x")
    elif entry == "epoch-0004.bak":
        shutil.copytree(p / "man" / "epoch-0001", target)              # a valid epoch under a wrong name
    else:
        target.mkdir()
    _refused(lambda: verify_path(p / "man"), entry)
    manifest.find_epochs(p / "man")                                     # inspect still lists the good ones


SUMMARY_EDITS = ["real_tokens", "padded_tokens", "sum_sq_len_max", "sum_sq_len_mean", "rank_imbalance_alpha",
                 "rank_imbalance_cost", "class_edges", "repeat_pair_against", "dropped_microbatches"]


@pytest.mark.parametrize("key", SUMMARY_EDITS + ["repeat_pair_rate@0"])
def test_verify_recomputes_every_summary_field(p, key):
    from .test_faults import _edited

    field, epoch = (key.split("@")[0], 0) if "@" in key else (key, 1)
    d = manifest.epoch_dir(p / "man", epoch)
    f = d / "manifest.json"
    h = json.loads(f.read_text())
    h["summary"][field] = 0.5 if h["summary"][field] is None else _edited(h["summary"][field])
    f.write_text(json.dumps(h))
    manifest.open(d)                                        # the loader does not read the summary ...
    _refused(lambda: verify_epoch(d), field)                # ... verify recomputes it


def test_verify_names_what_it_cannot_recompute(p):
    d = p / "man" / "epoch-0001"
    got = verify_epoch(d)
    assert set(got["unchecked"]) == {"predicted_efficiency", "split_microbatches"}
    assert got["unchecked"]["split_microbatches"] == verify_mod.NOT_RECOMPUTED["split_microbatches"]
    shutil.rmtree(p / "man" / "epoch-0000")                 # the rate's other epoch is gone: said, not passed
    got = verify_epoch(d)
    assert "epoch-0000" in got["unchecked"]["repeat_pair_rate"]
    f = d / "manifest.json"
    h = json.loads(f.read_text())
    h["summary"]["split_microbatches"] += 3
    h["summary"]["repeat_pair_rate"] = 0.123
    f.write_text(json.dumps(h))
    rc, err = _cli(["verify", "man/epoch-0001", "--data", "data"], p)
    assert rc == 0
    for name in ("predicted_efficiency", "split_microbatches", "repeat_pair_rate"):
        assert f"not recomputed: {name} (epoch-0001): " in err, err


# ----------------------------------------------------------------------------- 2. --out LINK
def _link_to_copy(p: Path, name: str) -> tuple[Path, Path]:
    real = p / f"real-{name}"
    shutil.copytree(p / name, real)
    link = p / f"link-{name}"
    link.symlink_to(real, target_is_directory=True)
    return link, real


def _no_debris(p: Path) -> None:
    left = [q.name for q in p.rglob("*") if q.name.startswith(".") and (".old-" in q.name or q.name.endswith(".tmp"))]
    assert not left, left


def test_tokenize_overwrite_through_a_link_replaces_its_target(p):
    link, real = _link_to_copy(p, "data")
    meta = tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus" / "chat.jsonl"),), out=link,
                                   max_len=300, shard_mb=0.02, overwrite=True))
    assert link.is_symlink() and Path(os.readlink(link)) == real     # the link stays a link ...
    assert open_dataset(real).fingerprint == meta["fingerprint"]     # ... and its target holds the new dataset
    assert open_dataset(real).meta["options"] != open_dataset(p / "data").meta["options"]
    _no_debris(p)


def test_every_folder_writer_goes_through_a_link(p):
    for name in ("corpus", "man"):
        _link_to_copy(p, name)
    synth(SynthConfig(out=p / "link-corpus", n=5, seed=3, overwrite=True))
    assert (p / "link-corpus").is_symlink() and len((p / "real-corpus" / "chat.jsonl").read_text().splitlines()) == 5
    dirs = pack_epochs(plan=p / "plan" / "plan.json", epochs=[0, 2], out=p / "link-man", world_size=2, overwrite=True)
    assert [d.name for d in manifest.find_epochs(p / "real-man")] == ["epoch-0000", "epoch-0001", "epoch-0002"]
    for d in dirs:
        verify_epoch(d)
    from dflash_prep.analyze.analyze import run

    (p / "real-an").mkdir()
    (p / "link-an").symlink_to(p / "real-an", target_is_directory=True)
    run(AnalyzeConfig(data=p / "data", out=p / "link-an", budget=1600, window=0, plot=False))
    assert (p / "link-an").is_symlink() and plan_mod.load(p / "real-an" / "plan.json").budget.value == 1600
    _no_debris(p)


def test_a_dangling_link_and_a_failing_delete_are_errors(p, monkeypatch):
    (p / "dangling").symlink_to(p / "nowhere")
    msg = _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=p / "dangling")),
                   "dangling")
    assert "nowhere" in msg and "does not exist" in msg
    assert not (p / "nowhere").exists()
    rmtree = shutil.rmtree

    def fail(path, *a, **k):                             # the swapped-out old version cannot be deleted
        if ".old-" not in str(path):
            return rmtree(path, *a, **k)
        if not k.get("ignore_errors"):
            raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "rmtree", fail)           # ... which is said, never swallowed
    msg = _refused(lambda: tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(p / "corpus"),), out=p / "data",
                                                   max_len=300, overwrite=True)), ".data.old-")
    assert "delete" in msg
    assert open_dataset(p / "data").meta["options"]["max_len"] == 300      # the new version is in place


# ----------------------------------------------------------------------------- 3. .npy headers
def _break_header(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    at = raw.index(b"'descr'") + len(b"'descr'")          # the ':' after 'descr': numpy's tokenizer fails
    raw[at] = ord("[")
    f.write_bytes(bytes(raw))


def test_corrupt_npy_header_is_a_format_error_everywhere(p):
    _break_header(p / "man" / "epoch-0001" / "dropped_ids.npy")
    _refused(lambda: manifest.open(p / "man" / "epoch-0001"), "dropped_ids.npy")     # the trainer's reader
    _refused(lambda: verify_epoch(p / "man" / "epoch-0001"), "dropped_ids.npy")
    _one_line_error(["verify", "man/epoch-0001"], p, "dropped_ids.npy")
    _break_header(p / "data" / "lengths.npy")
    _refused(lambda: open_dataset(p / "data"), "lengths.npy")
    _refused(lambda: lengths_mod.load(data=p / "data"), "lengths.npy")               # analyze and pack
    _one_line_error(["analyze", "data", "--out", "an", "--budget", "1600"], p, "lengths.npy")


# ----------------------------------------------------------------------------- 4. tokenizer folders
TOKENIZER_FIELDS = [("tokenizer_config.json", "chat_template", 42), ("tokenizer_config.json", "chat_template", None),
                    ("tokenizer_config.json", "chat_template", [{"name": 1}]), ("tokenizer_config.json", "eos_token", 3),
                    ("tokenizer_config.json", "add_bos_token", "yes"), ("tokenizer_config.json", "padding_side", 3),
                    ("tokenizer_config.json", "model_max_length", "x"),
                    ("tokenizer_config.json", "added_tokens_decoder", {"5": 3}),
                    ("special_tokens_map.json", "pad_token", [1]), ("chat_template.json", "chat_template", 7),
                    ("added_tokens.json", "<x>", "1"), ("tokenizer.json", "added_tokens", [{"id": "7"}]),
                    ("tokenizer.json", "model", 5)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from .assets.fixtures import train_bpe

    return train_bpe(tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("file,field,value", TOKENIZER_FIELDS, ids=[f"{a}:{b}={c!r}" for a, b, c in TOKENIZER_FIELDS])
def test_malformed_tokenizer_field_names_file_and_field(bpe, tmp_path, file, field, value):
    from dflash_prep.tokenize.encoders import load_tokenizer

    d = tmp_path / "tok"
    shutil.copytree(bpe, d)
    f = d / file
    obj = json.loads(f.read_text()) if f.is_file() else {}
    f.write_text(json.dumps({**obj, field: value}))
    with pytest.raises(InputError) as e:
        load_tokenizer(str(d))
    assert file in str(e.value) and repr(field) in str(e.value) and "\n" not in str(e.value), str(e.value)
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "yo"}]}) + "\n")
    _one_line_error(["tokenize", "c.jsonl", "--tokenizer", "tok", "--out", "o"], tmp_path, file)


# ----------------------------------------------------------------------------- 5. seeds
@pytest.mark.parametrize("seed", [-1, 2 ** 64, 2 ** 64 + 5])
def test_seed_outside_64_bits_is_refused(pipe, seed):
    src = lengths_mod.load(data=pipe / "data")
    with pytest.raises(ConfigError, match="outside 0..18446744073709551615"):
        plan_mod.Plan(data=src.describe(), boundaries=(200,), budget=plan_mod.Budget(value=1600), seed=seed)
    with pytest.raises(ConfigError, match="--seed"):
        AnalyzeConfig(data=pipe / "data", out=pipe / "an", budget=1600, seed=seed)
    _one_line_error(["analyze", "data", "--out", "an", "--budget", "1600", "--seed", str(seed)], pipe, "--seed")
    from dflash_prep.objectives.dflash import DrafterOptions

    with pytest.raises(ConfigError, match="--anchor-seed"):
        DrafterOptions(anchor_seed=seed)


def test_synth_seed_is_refused_below_zero_and_keyed_whole_above(tmp_path):
    _one_line_error(["synth", "--out", "s", "--n", "3", "--seed", "-1"], tmp_path, "--seed")
    for s in (0, 2 ** 64):                                   # numpy keys on all bits: no wrap-around
        synth(SynthConfig(out=tmp_path / str(s), n=3, seed=s))
    assert (tmp_path / "0" / "chat.jsonl").read_bytes() != (tmp_path / str(2 ** 64) / "chat.jsonl").read_bytes()


def test_epoch_outside_64_bits_is_refused(pipe, tmp_path):
    """The epoch keys the shuffles as the seed does: epoch 2^64 packed the batches of epoch 0."""
    for e in (2 ** 64, 2 ** 64 + 1):
        _refused(lambda: pack_epochs(plan=pipe / "plan" / "plan.json", epochs=[e], out=tmp_path / "m"), "epoch")
        _one_line_error(["pack", "data", "--plan", "plan/plan.json", "--out", str(tmp_path / "m"), "--epoch", str(e)],
                        pipe, "64 bits")
    assert not list(tmp_path.rglob("epoch-*"))         # nothing packed under the wrapped epoch


def test_seeds_in_range_keep_their_fingerprints_and_shuffles(pipe):
    from dflash_prep.pack.keyed import keyed_permutation

    src = lengths_mod.load(data=pipe / "data")
    plans = {s: plan_mod.Plan(data=src.describe(), boundaries=(200,), budget=plan_mod.Budget(value=1600),
                              seed=s).with_fingerprint() for s in (0, 1, 2 ** 64 - 1)}
    assert len({pl.fingerprint for pl in plans.values()}) == 3
    perms = {s: keyed_permutation(50, s, 0, 0).tobytes() for s in plans}
    assert len(set(perms.values())) == 3                  # distinct fingerprints, distinct shuffles
    # the pipeline's seed-0 plan (written before this check existed) still loads unchanged
    assert plan_mod.load(pipe / "plan" / "plan.json").fingerprint == \
        plan_mod.Plan(data=src.describe(), boundaries=(200,), budget=plan_mod.Budget(value=1600),
                      seed=0).with_fingerprint().fingerprint


# ----------------------------------------------------------------------------- 6. first assistant turn
OPENERS = [[{"role": "assistant", "content": "Hello, how can I help?"}],
           [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Sum 2+2"},
            {"role": "assistant", "content": "4"}],
           [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Ready."}]]


@pytest.mark.parametrize("n", range(len(OPENERS)))
def test_conversation_opening_with_an_assistant_turn_masks_like_transformers(bpe, n):
    from .assets.conversations import template
    from dflash_prep.tokenize.chat import MaskOptions, plan_rows
    from dflash_prep.tokenize.encoders import load_tokenizer

    tok = load_tokenizer(str(bpe), chat_template=template("chatml", False))
    assert not tok.has_generation
    msgs = OPENERS[n]
    rows, _ = plan_rows(msgs, tok.render, MaskOptions(), has_generation=False, control=tok.control)
    [(ids, mask)] = tok.encode_rows(rows)
    ref = tok.hf.apply_chat_template(msgs, chat_template=template("chatml", True), return_assistant_tokens_mask=True,
                                     return_dict=True)
    assert ids.tolist() == ref["input_ids"]
    assert mask.tolist() == ref["assistant_masks"], (tok.hf.decode(ids[mask == 1].tolist()),
                                                     tok.hf.decode([t for t, k in zip(ids.tolist(),
                                                                                      ref["assistant_masks"]) if k]))
    assert "<|im_start|>assistant" not in tok.hf.decode(ids[mask == 1].tolist())

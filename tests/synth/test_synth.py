"""synth: reproducible, plausible chat whose byte-level lengths are exactly the profile's."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dflash_prep.errors import ConfigError, FormatError
from dflash_prep.formats.fileio import read_json
from dflash_prep.synth.profiles import make_lengths
from dflash_prep.synth.synth import CORPUS_FILE, META_FILE, SYNTH_FORMAT, SynthConfig, synth
from dflash_prep.tokenize.encoders import ByteTokenizer, encode_chats


def _rows(folder):
    return [json.loads(line) for line in (folder / CORPUS_FILE).read_text().splitlines()]


@pytest.mark.parametrize("profile", ["seedlike", "bimodal"])
def test_lengths_match_profile_exactly(tmp_path, profile):
    synth(SynthConfig(out=tmp_path / "c", profile=profile, n=300, seed=3))
    tok = ByteTokenizer()
    got = np.array([len(ids) for ids, _ in encode_chats(tok, [r["messages"] for r in _rows(tmp_path / "c")])])
    want = make_lengths(profile, 300, 3)
    assert np.array_equal(got, want), f"max abs diff {np.abs(got - want).max()}"


def test_deterministic_and_seed_sensitive(tmp_path):
    synth(SynthConfig(out=tmp_path / "a", n=50, seed=1))
    synth(SynthConfig(out=tmp_path / "b", n=50, seed=1))
    synth(SynthConfig(out=tmp_path / "c", n=50, seed=2))
    a, b, c = ((tmp_path / x / CORPUS_FILE).read_bytes() for x in "abc")
    assert a == b and a != c
    meta = read_json(tmp_path / "a" / META_FILE, format=SYNTH_FORMAT)
    assert meta["n"] == 50 and meta["target_tokens"] == int(make_lengths("seedlike", 50, 1).sum(dtype=np.int64))


def test_text_is_plausible_chat(tmp_path):
    synth(SynthConfig(out=tmp_path / "c", n=200))
    rows = _rows(tmp_path / "c")
    text = " ".join(m["content"] for r in rows for m in r["messages"])
    words = re.findall(r"[A-Za-z]+", text)
    assert len(set(words)) > 100 and np.mean([len(w) for w in words]) < 8  # real words, not "aaaa"
    for mark in (". ", ", ", "?", "def ", "```python", "return ", "\n- "):
        assert mark in text, mark
    for r in rows:
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) >= 2
        assert all(m["content"] for m in r["messages"])


def test_bad_options_and_existing_output(tmp_path):
    with pytest.raises(ConfigError, match="--n"):
        SynthConfig(out=tmp_path / "x", n=0)
    with pytest.raises(ConfigError, match="profile"):
        SynthConfig(out=tmp_path / "x", profile="nope")
    synth(SynthConfig(out=tmp_path / "c", n=5))
    with pytest.raises(FormatError, match="--overwrite"):
        synth(SynthConfig(out=tmp_path / "c", n=5))
    synth(SynthConfig(out=tmp_path / "c", n=7, overwrite=True))
    assert len(_rows(tmp_path / "c")) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp folders left behind

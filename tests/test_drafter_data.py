"""Drafter data: tokenize's mask counts, pack --objective dflash, verify of anchors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_prep import anchors
from dflash_prep.dataset import open_dataset
from dflash_prep.errors import FormatError
from dflash_prep.lengths import read_mask_counts
from dflash_prep.tokenize import TokenizeConfig, tokenize

from .assets.fixtures import CHATS, write_jsonl


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A byte-tokenized chat dataset: the fixture chats repeated with varied lengths."""
    tmp = tmp_path_factory.mktemp("drafter")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(240):
        c = CHATS[i % len(CHATS)]
        rows.append({"messages": [dict(m, content=m["content"] * int(rng.integers(1, 12))) for m in c]})
    f = write_jsonl(tmp / "chat.jsonl", rows)
    tokenize(TokenizeConfig(inputs=(str(f),), out=tmp / "data", chunk_rows=50))
    return tmp / "data"


def test_tokenize_records_mask_counts(dataset):
    mc = read_mask_counts(dataset)
    ds = open_dataset(dataset)
    for i in range(len(ds)):
        _, mask = ds.sample(i)
        assert (int(mc.supervised[i]), int(mc.anchor_candidates[i])) == anchors.mask_counts(mask)
    assert mc.anchor_candidates.sum() > 0


def test_old_dataset_without_mask_counts_says_retokenize(dataset, tmp_path):
    import shutil
    old = tmp_path / "old"
    shutil.copytree(dataset, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["anchor_candidates"]
    (old / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="--overwrite"):
        read_mask_counts(old)
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    np.save(bad / "supervised.npy", np.asarray(np.load(bad / "supervised.npy")) + 1)
    with pytest.raises(FormatError, match="does not match"):
        read_mask_counts(bad)

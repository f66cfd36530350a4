"""open_dataset: zero-copy samples, checks on open, and the two other readers (pyarrow, datasets)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from dflash_prep.errors import FingerprintMismatch, FormatError
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.lengths import read_dataset_lengths
from dflash_prep.synth.profiles import make_lengths
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

N = 120


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    synth(SynthConfig(out=root / "corpus", n=N, seed=5))
    meta = tokenize(TokenizeConfig(inputs=(str(root / "corpus"),), out=root / "data", tokenizer="byte", shard_mb=0.05,
                                    chunk_rows=16))
    return root / "data", meta


def test_open_and_sample(built):
    folder, meta = built
    ds = open_dataset(folder)
    assert len(ds) == N and ds.fingerprint == meta["fingerprint"] and ds.meta["counts"]["samples"] == N
    assert isinstance(ds.lengths, np.memmap) and ds.lengths.dtype == np.int32
    assert np.array_equal(ds.lengths, make_lengths("seedlike", N, 5))  # synth lengths survive tokenize exactly
    assert len(meta["shards"]) > 2
    for i in (0, 1, N // 2, N - 1):
        ids, mask = ds.sample(i)
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and len(ids) == len(mask) == ds.lengths[i]
        assert not ids.flags.owndata and not ids.flags.writeable  # a view into the memory map
        assert 0 < mask.sum() < len(mask)
    info = ds.tokenizer_info
    assert info == {"vocab_size": 259, "pad_id": 256, "eos_id": 256, "bos_id": None, "name": "byte",
                    "fingerprint": meta["tokenizer"]["fingerprint"]}
    with pytest.raises(IndexError):
        ds.sample(N)
    src = read_dataset_lengths(folder)  # what analyze and pack read
    assert src.fingerprint == ds.fingerprint and np.array_equal(src.lengths, ds.lengths)


def test_pyarrow_mmap_and_datasets_agree(built):
    import datasets

    folder, meta = built
    ds = open_dataset(folder)
    hf = datasets.load_from_disk(str(folder))
    assert len(hf) == N and hf.features["input_ids"].feature.dtype == "int32"
    for sh in meta["shards"]:
        with pa.memory_map(str(folder / sh["file"])) as mm:
            table = pa.ipc.open_stream(mm).read_all()
        assert table.num_rows == sh["rows"]
        assert table.column("id").to_pylist() == list(range(sh["first_id"], sh["first_id"] + sh["rows"]))
        one = datasets.Dataset.from_file(str(folder / sh["file"]))
        r = one[0]
        ids, mask = ds.sample(sh["first_id"])
        assert r["id"] == sh["first_id"] and r["input_ids"] == ids.tolist() and r["loss_mask"] == mask.tolist()
    for i in (3, N - 2):
        assert hf[i]["input_ids"] == ds.sample(i)[0].tolist() and hf[i]["length"] == ds.lengths[i]


def _copy(folder, tmp_path):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def test_edited_lengths_are_rejected(built, tmp_path):
    d = _copy(built[0], tmp_path)
    arr = np.load(d / "lengths.npy")
    arr[0] += 1
    np.save(d / "lengths.npy", arr)
    with pytest.raises(FingerprintMismatch, match="lengths.npy"):
        open_dataset(d)


def test_truncated_shard_is_rejected(built, tmp_path):
    d = _copy(built[0], tmp_path)
    shard = d / built[1]["shards"][1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="shard-00001"):
        open_dataset(d)


def test_missing_shard_and_wrong_version(built, tmp_path):
    d = _copy(built[0], tmp_path)
    (d / built[1]["shards"][0]["file"]).unlink()
    with pytest.raises(FormatError, match="missing"):
        open_dataset(d)
    meta = json.loads((built[0] / "meta.json").read_text())
    meta["version"] = 99
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match="version 99"):
        open_dataset(d)


def test_shard_from_another_run_is_rejected(built, tmp_path):
    d = _copy(built[0], tmp_path)
    other = tokenize(TokenizeConfig(inputs=(str(built[0].parent / "corpus"),), out=tmp_path / "other", tokenizer="byte",
                                    shard_mb=0.05, chunk_rows=16, max_len=4000))
    name = built[1]["shards"][0]["file"]
    (d / name).write_bytes((tmp_path / "other" / other["shards"][0]["file"]).read_bytes())
    with pytest.raises((FingerprintMismatch, FormatError)):
        open_dataset(d)

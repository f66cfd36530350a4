"""Checks that every shipped prompt set's tests make (evaluation sets and training prompts alike):
the files match their manifest, a copy of the folder, a rebuild that is byte for byte the same, the
recorded upstream identity, and the machine-independent gzip header. They test the machinery of
:mod:`dflash_prep.evalsets.shipped`; imported as ``dflash_prep.tests.evalsets.shipped_checks``."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from dflash_prep.errors import InputError


def one_line(e: pytest.ExceptionInfo) -> str:
    """The exception's message, asserted to be one line."""
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def write_upstream(folder: Path, files: dict[str, tuple[str, bytes | str]]) -> dict[str, Path]:
    """Write ``{set: (file name, bytes or text)}`` into ``folder``; return ``{set: path}``, the
    ``inputs`` of a ``build``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (fname, data) in files.items():
        (folder / fname).write_bytes(data if isinstance(data, bytes) else data.encode())
        out[name] = folder / fname
    return out


def check_manifest_hashes(root: Path, fmt: str) -> dict:
    """``root/manifest.json``, asserted to be ``fmt`` v1 with each set's file matching its sha256 and
    content sha256; returns the manifest."""
    manifest = json.loads((root / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == (fmt, 1)
    for e in manifest["sets"]:
        data = (root / e["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == e["sha256"], e["name"]
        assert hashlib.sha256(gzip.decompress(data)).hexdigest() == e["content_sha256"], e["name"]
    return manifest


def copy_sets(root: Path, dst: Path) -> Path:
    """A copy of the shipped folder ``root`` (manifest.json and data/) at ``dst``."""
    shutil.copytree(root / "data", dst / "data")
    shutil.copy(root / "manifest.json", dst / "manifest.json")
    return dst


def check_rebuild(build: Callable[..., dict], upstream: dict[str, Path], tmp_path: Path) -> tuple[dict, Path]:
    """``build(upstream)`` twice, into ``tmp_path/a`` and ``tmp_path/b``: asserts the same bytes in every
    file and the returned manifest equal to the written one; returns it and the folder ``a``."""
    m1 = build(upstream, out=tmp_path / "a")
    m2 = build(upstream, out=tmp_path / "b")
    for f in ["manifest.json"] + [e["file"] for e in m1["sets"]]:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert m1 == m2 == json.loads((tmp_path / "a" / "manifest.json").read_text())
    return m1, tmp_path / "a"


def check_build_refusals(build: Callable[..., dict], upstream: dict[str, Path], tmp_path: Path, *, why: str,
                         first: str, missing: str) -> None:
    """``build`` refuses ``upstream`` (which the caller has damaged) in one line that holds ``why``, and
    the ``first`` set's file alone in one line that holds ``missing`` (the other sets, in order)."""
    with pytest.raises(InputError) as e:
        build(upstream, out=tmp_path / "o3")
    assert why in one_line(e)
    with pytest.raises(InputError) as e:
        build({first: upstream[first]}, out=tmp_path / "o4")
    assert missing in one_line(e)


def check_upstream_identity(manifest: dict, upstream: dict[str, Path]) -> None:
    """The recorded upstream identity of every set is its file's own: git's blob id and its sha256."""
    for e in manifest["sets"]:
        blob = subprocess.run(["git", "hash-object", str(upstream[e["name"]])], capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
        assert e["source"]["git_blob"] == blob, e["name"]
        assert e["source"]["sha256"] == hashlib.sha256(upstream[e["name"]].read_bytes()).hexdigest()


def check_gzip_header(path: Path) -> None:
    """A shipped file's gzip header: no name, mtime 0, OS byte 255, so its bytes do not depend on the machine."""
    head = path.read_bytes()[:10]
    assert head[3] == 0 and head[4:8] == b"\0\0\0\0" and head[9] == 255

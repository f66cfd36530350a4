"""Checks on tokenize's input files before any loader sees them.

A loader handed a FIFO blocks forever, one handed ``/dev/zero`` fills memory, and
pyarrow's JSON reader crashes (SIGSEGV) or Python's recurses out on JSON nested tens of
thousands of levels deep; non-UTF-8 bytes surface as a traceback deep inside pyarrow.
So, before loading:

- every input path must be a regular file, or a folder (a ``save_to_disk`` dataset);
- every JSON/JSONL file is streamed once through :func:`_scan` (numba, ~1 GB/s): the
  bytes must be valid UTF-8 (checked by Python's incremental decoder, chunk by chunk) and
  no value may nest deeper than :data:`MAX_DEPTH` brackets (counted outside strings,
  honouring backslash escapes). The error names the file and line.

The scan reads each JSON input once more (the page cache usually holds it for the loader).
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep.errors import InputError

MAX_DEPTH = 64            # chat records nest ~4 levels; Python's json recurses ~1000 deep
CHUNK = 8 << 20


@nb.njit(cache=True)
def _scan(buf, state):
    """Walk JSON bytes; ``state`` = [depth, in_string, escaped, line, max_depth, bad_line].

    Returns the index of the first byte that pushes the depth past ``state[4]``, else -1.
    Lines count ``\\n`` bytes; state carries across chunks.
    """
    depth, in_str, esc, line, limit = state[0], state[1], state[2], state[3], state[4]
    for i in range(buf.shape[0]):
        c = buf[i]
        if c == 10:
            line += 1
            if not in_str:
                depth = 0  # JSON Lines: every line starts a new value (a JSON array file never breaks mid-token)
        if in_str:
            if esc:
                esc = 0
            elif c == 92:       # backslash
                esc = 1
            elif c == 34:       # closing quote
                in_str = 0
        elif c == 34:
            in_str = 1
        elif c == 91 or c == 123:   # [ {
            depth += 1
            if depth > limit:
                state[0], state[1], state[2], state[3], state[5] = depth, in_str, esc, line, line
                return i
        elif c == 93 or c == 125:   # ] }
            depth -= 1
    state[0], state[1], state[2], state[3] = depth, in_str, esc, line
    return -1


def _check_kind(path: str) -> None:
    try:
        st = os.stat(path)
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror}); check the path and permissions") from None
    if stat.S_ISDIR(st.st_mode):
        return
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise InputError(f"{path}: is {kind}; tokenize reads regular files only. Write the data to a file first")


def check_json_file(path: str, *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a JSON/JSONL file that is not UTF-8 or nests deeper than ``max_depth``."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    state = np.array([0, 0, 0, 1, max_depth, 0], np.int64)
    seen = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            final = not chunk
            try:
                dec.decode(chunk, final=final)
            except UnicodeDecodeError as e:
                line = 1 + chunk[:max(0, e.start)].count(b"\n") + int(state[3]) - 1
                raise InputError(f"{path}:{line}: not UTF-8 text (byte 0x{chunk[e.start]:02x} at offset "
                                 f"{seen + e.start}); re-encode the file as UTF-8") from None
            if final:
                return
            if _scan(np.frombuffer(chunk, np.uint8), state) >= 0:
                raise InputError(f"{path}:{int(state[5])}: JSON nested deeper than {max_depth} levels; a record is "
                                 "a few levels deep (messages -> message -> fields). Fix or remove that line")
            seen += len(chunk)


def check_inputs(files: list[tuple[str, str]]) -> None:
    """Run the checks on ``records.expand``'s ``[(path, kind)]``."""
    for path, kind in files:
        _check_kind(path)
        if kind == "json" and Path(path).is_file():
            check_json_file(path)

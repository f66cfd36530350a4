"""What the ``regenerate``-against-real-vLLM tests share: their tiny target, their prompts, and a
server killed midway that is midway however fast the machine is.

:func:`kill_midway` used to poll the output and kill the server once ``after`` records were on
disk; on a fast or busy machine the client wrote all of them between two polls (a CI run saw
16/16 at 34 records/s and a client that never saw the kill). Now the client is stopped (SIGSTOP)
the moment ``after`` records are on disk, the server's whole group is SIGKILLed, the count is read
while nothing can write, and only then does the client go on (SIGCONT): it finds its server gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from dflash_prep.regenerate.store import entries_on_disk

WORDS = "list tuple loop value key string parse file number graph".split()


def write_prompts(path: Path, n: int) -> Path:
    """``n`` single-turn prompts; the first ``m`` of any two such files are the same."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Explain {WORDS[i % 10]} {i}."}]})
                            + "\n" for i in range(n)))
    return path


def build_regen_target(folder: Path) -> Path:
    """The regenerate tests' tiny random Qwen3 (non-empty answers; head_dim 32 for vLLM's CPU build)."""
    from dflash_prep.train.target_init import TargetSpec, build_target, default_texts

    spec = TargetSpec(vocab_size=512, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128)
    return build_target(folder, spec, default_texts(60_000))


def kill_midway(client: subprocess.Popen, out: Path, server_pgid: int, after: int, timeout_s: float = 240.0) -> int:
    """Once ``after`` records of ``client`` (a running ``regenerate``) are in ``out``: stop the
    client, SIGKILL the server's group (API server, engine core, worker), let the client go on.
    Returns the records on disk at the kill; the caller asserts it is midway."""
    deadline = time.monotonic() + timeout_s
    while entries_on_disk(out) < after and client.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    stopped = client.poll() is None
    if stopped:
        os.kill(client.pid, signal.SIGSTOP)
    try:
        os.killpg(server_pgid, signal.SIGKILL)
        return entries_on_disk(out)
    finally:
        if stopped:
            os.kill(client.pid, signal.SIGCONT)

"""Regenerate throughput against a local ``transformers serve`` and the in-process engine.

    python -m dflash_prep.bench.regenerate_speed                      # docs/benchmarks.md#regenerate-throughput (CPU, a few minutes)
    python -m dflash_prep.bench.regenerate_speed --n 16 --concurrency 4   # quicker

What is timed: ``dflash_prep.regenerate.regenerate.run`` on N single-turn prompts (synth text, 40-400
characters), greedy, ``--max-tokens`` new tokens per answer, into a fresh output folder.
Rates are the run's own: requests and completion tokens per second of generation, start-up
(server launch, model load, imports) excluded; the server's start-up and its first request
(one warm-up prompt, where continuous batching allocates its cache) are printed apart.
Rows: the openai engine against ``transformers serve`` (sequential ``generate``, one request
at a time) at several ``--concurrency``, the same server with ``--continuous-batching``
when it starts on this machine, and ``--engine hf`` (batched ``generate`` in process).
The target is the demo's tiny random Qwen3 (:mod:`dflash_prep.train.target_init`, d_model
128, 4 layers) unless ``--target`` names another; weights are random, so most answers run
to ``--max-tokens``. Server and in-process engine run ``--threads`` torch threads (default 1,
for a shared machine). The 1-minute load average is printed with each row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dflash_prep.regenerate.engines import Sampling
from dflash_prep.regenerate.regenerate import RegenerateConfig, run

SERVE = ("import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; "
         "sys.exit(main())")


def running_in_group(pgid: int) -> list[int]:
    """Pids, sorted, of the processes of process group ``pgid`` that have not exited: from
    ``/proc/PID/stat``, every state but zombie (``Z``) and dead (``X``). A zombie has exited and
    holds nothing (memory, files, ports, semaphores) but its process-table entry, which only its
    parent removes, by reaping it; one whose parent has exited is reparented to PID 1 (or the
    nearest child subreaper), which reaps it when it gets to it. Without ``/proc`` (not Linux),
    ``[pgid]`` while ``killpg(pgid, 0)`` finds any process of the group, zombies included,
    else ``[]``."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited and reaped since the listing
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(name))
    return sorted(out)


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0, kill_wait_s: float = 10.0) -> None:
    """Stop ``proc`` (a process group leader, ``start_new_session=True``) and its whole group:
    SIGTERM to the group, then wait until ``proc`` has exited (reaped here) and no process of
    the group runs (:func:`running_in_group`); after ``grace_s`` seconds, SIGKILL to the group
    and wait up to ``kill_wait_s`` seconds more the same way. Waiting for ``proc`` alone is not
    enough: ``transformers serve`` (5.25) spawns its model's process and a ``multiprocessing``
    resource tracker in its group, and the tracker ignores SIGTERM and exits only once every
    holder of its pipe (the server, the model's process) has, after unlinking the semaphores
    they leaked. Zombies may stay: those members are the server's children, reparented to
    PID 1 once it exits, and only PID 1 can reap them. Raises RuntimeError naming the pids
    still running after SIGKILL (a process in uninterruptible sleep)."""
    pgid = proc.pid

    def ended(deadline: float) -> bool:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        while running_in_group(pgid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    with contextlib.suppress(ProcessLookupError):  # the whole group had exited already
        os.killpg(pgid, signal.SIGTERM)
    if ended(time.monotonic() + grace_s):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    if not ended(time.monotonic() + kill_wait_s):
        raise RuntimeError(f"process group {pgid} still runs {kill_wait_s:g} s after SIGKILL: pids "
                           f"{running_in_group(pgid)}")


@contextlib.contextmanager
def local_server(target: Path, *extra: str, log: Path, threads: int = 1, timeout_s: float = 300):
    """``transformers serve TARGET`` on a free 127.0.0.1 port (CPU), in its own process group;
    yields (base_url, start seconds, process). On exit the group is stopped with
    :func:`stop_group` (SIGTERM, SIGKILL after 30 s): the server is reaped and no process of
    its group runs any more. The tests start their server through this too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(threads)}
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", str(target), "--host", "127.0.0.1", "--port",
                                 str(port), "--device", "cpu", *extra], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"transformers serve did not start: {log.read_text()[-1500:]}") from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", time.monotonic() - t0, proc
    finally:
        stop_group(proc)


def prompts(n: int) -> list[dict]:
    from dflash_prep.synth.synth import _pool

    text = _pool(1)
    out, pos = [], 0
    for i in range(n):
        k = 40 + (i * 97) % 360
        out.append({"messages": [{"role": "user", "content": text[pos:pos + k].strip() or "Hello"}]})
        pos += k
    return out


def measure(name: str, cfg: RegenerateConfig) -> dict:
    load = os.getloadavg()[0]
    s = run(cfg)
    st = s["stats"]
    row = {"row": name, "records": st["records_written"], "requests": s["requests"],
           "completion_tokens": s["completion_tokens"], "seconds": s["elapsed_s"], "req_per_s": s["requests_per_s"],
           "tok_per_s": s["tokens_per_s"], "load_1min": round(load, 1)}
    print(f"{name:<44} {row['requests']:>5} req {row['seconds']:>7.1f} s {row['req_per_s']:>7.2f} req/s "
          f"{row['tok_per_s']:>8.0f} tok/s  load {row['load_1min']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.bench.regenerate_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32, help="prompts")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4", help="openai rows, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and the hf engine")
    ap.add_argument("--batch-size", type=int, default=8, help="hf engine row")
    ap.add_argument("--target", type=Path, help="model folder (default: build the demo's tiny Qwen3)")
    ap.add_argument("--no-cb", action="store_true", help="skip the --continuous-batching server")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="regen-bench-") as tmp:
        tmp = Path(tmp)
        target = a.target
        if target is None:
            from dflash_prep.train.target_init import build_target

            target = build_target(tmp / "target")
        corpus = tmp / "prompts.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in prompts(a.n)))
        one = tmp / "warm-up.jsonl"
        one.write_text(json.dumps({"messages": [{"role": "user", "content": "Warm up."}]}) + "\n")
        sampling = Sampling(temperature=0.0, max_tokens=a.max_tokens)
        print(f"regenerate: {a.n} prompts, greedy, max_tokens {a.max_tokens}, target {target}", flush=True)
        servers = [("transformers serve", ())] + ([] if a.no_cb else [("transformers serve --continuous-batching",
                                                                      ("--continuous-batching",))])
        for label, extra in servers:
            try:
                with local_server(target, *extra, log=tmp / "serve.log", threads=a.threads) as (url, start, _):
                    warm = RegenerateConfig(inputs=(str(one),), out=tmp / f"warm-{len(rows)}", base_url=url,
                                            model=str(target), concurrency=1, sampling=sampling)
                    t0 = time.monotonic()
                    run(warm)  # lazy start-up (continuous batching allocates its cache on the first request)
                    print(f"{label}: up in {start:.1f} s, first request {time.monotonic() - t0:.1f} s", flush=True)
                    for c in (int(x) for x in a.concurrency.split(",")):
                        cfg = RegenerateConfig(inputs=(str(corpus),), out=tmp / f"out-{len(rows)}", base_url=url,
                                               model=str(target), concurrency=c, sampling=sampling)
                        rows.append(measure(f"openai, {label}, concurrency {c}", cfg))
            except Exception as e:  # a server mode that does not run here is reported, not fatal
                print(f"{label}: skipped ({type(e).__name__}: {str(e)[:300]})", flush=True)
        cfg = RegenerateConfig(inputs=(str(corpus),), out=tmp / "out-hf", engine="hf", target=target,
                               batch_size=a.batch_size, device="cpu", sampling=sampling)
        rows.append(measure(f"hf, batch {a.batch_size}", cfg))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"n": a.n, "max_tokens": a.max_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

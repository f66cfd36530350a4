"""What the target-rank transport costs on CPU: gloo throughput and per-message overhead.

``python -m dflash_prep.bench.target_link`` starts two gloo processes on this machine: one sends
messages through :class:`dflash_prep.train.split.link.TapsSender` (``--prefetch`` in
flight), the other takes them with :class:`~dflash_prep.train.split.link.TapsReceiver`
and checks every tag, exactly as a drafter rank does. Payloads are fp32 taps ``[T, k*H]``:
the demo target's (``make demo-dflash``: H = 64, one tapped layer, T = its 2,048-token
budget) and a tiny one (one token) whose time is the per-message overhead (header, tag
check, three point-to-point operations). Per size it reports the median over ``--repeats``
runs of ``--messages`` messages: seconds per message, MB/s of payload, and the sender's
CPU seconds per message; and the best run (on a shared machine, the closest to the cost itself). For scale it also times the demo target's own forward over the
same 2,048 tokens (random weights of the demo's shape, eight 256-token documents, fp32, one
thread): the target step the transport rides beside. Prints one JSON object (and writes it
to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SIZES = {"one token": (1, 64), "demo target, T = 2048": (2048, 64), "4x the demo taps, T = 8192": (8192, 64)}


def _rank(rank: int, init: str, messages: int, repeats: int, prefetch: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from dflash_prep.train.split.link import Tag, TapsReceiver, TapsSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    res = {}
    for name, shape in SIZES.items():
        taps = torch.randn(shape)
        runs = []
        for rep in range(repeats + 1):   # the first run warms the connection and is dropped
            tags = [Tag.of(rep, i, 0, [i, rep]) for i in range(messages)]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                s = TapsSender({1: "drafter rank 0"}, prefetch=prefetch, timeout=60.0)
                for tag in tags:
                    s.send(1, tag, [taps])
                s.flush()
            else:
                r = TapsReceiver(0, timeout=60.0)
                for tag in tags:
                    r.recv(tag)
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
        wall = statistics.median(w for w, _ in runs[1:])
        cpu = statistics.median(c for _, c in runs[1:])
        nbytes = taps.numel() * 4
        best = min(w for w, _ in runs[1:])
        res[name] = {"shape": list(shape), "payload_bytes": nbytes, "s_per_message": wall / messages,
                     "MB_per_s": nbytes * messages / wall / 1e6, "cpu_s_per_message": cpu / messages,
                     "best_s_per_message": best / messages, "best_MB_per_s": nbytes * messages / best / 1e6}
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def demo_forward_s(repeats: int = 5) -> float:
    """Median seconds of one tapped forward of the demo target's shape over 2,048 tokens."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_prep.train.target import ATTN_IMPL, FrozenTarget, register_attention

    torch.set_num_threads(1)
    register_attention()
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    cfg._attn_implementation = ATTN_IMPL
    torch.manual_seed(0)
    t = FrozenTarget.from_model(Qwen3ForCausalLM(cfg), [2], device=torch.device("cpu"))  # one draft layer taps L//2
    ids = torch.randint(4, 512, (2048,))
    pos = torch.arange(2048) % 256                         # eight documents of 256 tokens
    cu = torch.arange(0, 2049, 256, dtype=torch.int32)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        taps = t.features(ids, pos, cu, 256)                # (2048, 64)
        times.append(time.perf_counter() - t0)
    if tuple(taps.shape) != SIZES["demo target, T = 2048"]:
        raise RuntimeError(f"demo taps are {tuple(taps.shape)}, the bench sends {SIZES['demo target, T = 2048']}")
    return statistics.median(times[1:])


def run(messages: int = 200, repeats: int = 3, prefetch: int = 2) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "init"), messages, repeats, prefetch, out), nprocs=2, join=True)
        sizes = json.loads(Path(out).read_text())
    fwd = demo_forward_s()
    demo = sizes["demo target, T = 2048"]["s_per_message"]
    return {"bench": "target_link", "backend": "gloo (CPU, two processes on one machine)", "messages": messages,
            "repeats": repeats, "prefetch": prefetch, "cpus": os.cpu_count(), "sizes": sizes,
            "demo_target_forward_s": fwd, "demo_transport_share_of_forward": demo / fwd,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    res = run(a.messages, a.repeats, a.prefetch)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

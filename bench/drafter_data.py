"""Data paths for DFlash drafter training, side by side (issue 14).

``python -m dflash_prep.bench.drafter_data`` compares, in one run, three ways of feeding a drafter
trainer, on two inputs:

- *seedlike*: definitions.md's 902,087 seedlike lengths with synthetic loss masks: a prompt
  prefix of ``floor(u * L)`` tokens, ``u ~ U(0, 0.8)`` (keyed), then a supervised response;
  T = 65536;
- *demo*: the ``make demo`` corpus (``synth --profile mini``, 20,000 chats, byte tokenizer,
  ``--max-len 2048``) tokenized here with its real masks; T = 4096 as in ``make demo``.

Paths, W = 8 ranks, one micro-batch per rank per step:

(a) *recipe*: the public recipe's path: a random order each epoch, micro-batches of 2
    padded to the longer, every row given ``min(512, most candidates in the micro-batch)``
    blocks; consecutive micro-batches go to ranks 0..W-1 (a DistributedSampler);
(b) *multipack*: a multipack-style static packer: first-fit decreasing of the lengths into
    rows of T tokens (varlen, anchors per document), then longest-processing-time across
    ranks on tokens (equal row counts), each rank's rows in a keyed random order per epoch;
(c) *ours*: ``pack --objective dflash`` (:func:`dflash_prep.pack.pack.build_epoch`, the code
    behind the CLI, anchor digest included).

Reported per path: useful target tokens / computed (padding is computed), useful anchor
slots / computed (a padded row computes its micro-batch's most blocks), drafter-cost rank
imbalance (:mod:`dflash_prep.objectives.drafter_cost`, Qwen3-8B-sized target, 5 draft layers,
B = 16; padding and padded blocks are priced as real work), repeat-pair rate 0 -> 1, step
mix, and pack seconds per epoch (wall and CPU, warm: median of ``--repeats`` epochs).
``--scale 10000000,30000000`` adds one epoch of ours per size, each in a fresh subprocess
(wall, CPU, peak RSS, then the seconds to hash and write its manifest as ``pack`` does).
Output: a markdown table on stdout and ``--out/drafter_data.json`` (format
``dflash-prep/bench-drafter-data`` v1). Nothing here is committed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numba as nb
import numpy as np

from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import manifest
from dflash_prep.formats.fileio import atomic_write_json, fingerprint_array
from dflash_prep.formats.plan import Budget, Plan
from dflash_prep.objectives.dflash import DrafterOptions
from dflash_prep.objectives.drafter_cost import DrafterCostModel, sample_cost
from dflash_prep.pack import metrics, pack
from dflash_prep.pack.batch_stats import class_edges
from dflash_prep.pack.keyed import keyed_permutation
from dflash_prep.pack.config import PackConfig
from dflash_prep.synth import profiles

W = 8
B = 16
MAX_ANCHORS = 512
QWEN3_8B = DrafterCostModel(hidden=4096, layers=36, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                            vocab=151936, draft_layers=5)
PURPOSE_BENCH = 0x62656E6368


# ----------------------------------------------------------------------------- inputs
def seedlike_inputs(n: int, seed: int = 0):
    """Seedlike lengths and the exact (S, C) of the synthetic prompt-then-response masks."""
    lens = profiles.make_lengths("seedlike", n=n)
    u = np.random.default_rng(seed).uniform(0.0, 0.8, len(lens))
    s = (lens - np.floor(u * lens).astype(np.int64)).astype(np.int32)       # supervised response
    return lens, lengths_mod.MaskCounts(supervised=s, anchor_candidates=np.maximum(s - 1, 0).astype(np.int32))


def demo_inputs(n: int, work: Path):
    """The ``make demo`` corpus, tokenized with real masks: (lengths, mask counts)."""
    from dflash_prep.synth.synth import SynthConfig, synth
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    synth(SynthConfig(out=work / "corpus", profile="mini", n=n, seed=0, overwrite=True))
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(work / "corpus" / "chat.jsonl"),), out=work / "data", max_len=2048,
                            overwrite=True))
    return np.asarray(lengths_mod.read_dataset_lengths(work / "data").lengths), lengths_mod.read_mask_counts(work / "data")


# ----------------------------------------------------------------------------- (a) recipe
def recipe_epoch(lens, k, epoch: int, seed: int = 0):
    """Random order, pairs padded to the longer: (order, offsets)."""
    order = keyed_permutation(len(lens), seed, epoch, PURPOSE_BENCH)
    offsets = np.append(np.arange(0, len(lens), 2, dtype=np.int64), len(lens))
    return order, offsets


# ----------------------------------------------------------------------------- (b) multipack
@nb.njit(cache=True)
def _ffd(sorted_lens, cap, bin_of):
    # first-fit decreasing with a max segment tree over the bins' free room (leftmost fit)
    n = sorted_lens.shape[0]
    size = 1
    while size < n:
        size *= 2
    tree = np.full(2 * size, cap, np.int64)      # every leaf starts as an empty bin
    used = 0
    for i in range(n):
        L = sorted_lens[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= L else 2 * node + 1
        b = node - size
        bin_of[i] = b
        used = max(used, b + 1)
        tree[node] -= L
        node //= 2
        while node >= 1:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return used


def multipack_rows(lens, cap: int):
    """FFD into rows of ``cap`` tokens: (order, offsets), rows in bin order."""
    by_len = np.argsort(-np.asarray(lens, np.int64), kind="stable")
    bin_of = np.empty(len(lens), np.int64)
    m = _ffd(np.asarray(lens, np.int64)[by_len], int(cap), bin_of)
    grp = np.argsort(bin_of, kind="stable")
    order = by_len[grp]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(bin_of, minlength=m))]).astype(np.int64)
    return order, offsets


def multipack_epoch(rows, lens, epoch: int, seed: int = 0):
    """LPT of the static rows over W ranks on tokens (equal counts), keyed order per rank.
    Returns (order, offsets, step, rank) with rows in step-major order."""
    order, offsets = rows
    tok = np.add.reduceat(np.asarray(lens, np.int64)[order], offsets[:-1])
    m = len(tok) - len(tok) % W
    per = m // W
    load, cnt = np.zeros(W), np.zeros(W, np.int64)
    rank_rows = [[] for _ in range(W)]
    for r in np.argsort(-tok[:m], kind="stable"):
        free = np.flatnonzero(cnt < per)
        j = free[np.argmin(load[free])]
        rank_rows[j].append(r)
        load[j] += tok[r]
        cnt[j] += 1
    for j in range(W):
        perm = keyed_permutation(per, seed, epoch, PURPOSE_BENCH + 1 + j)
        rank_rows[j] = np.asarray(rank_rows[j], np.int64)[perm]
    rows_seq = np.stack(rank_rows, axis=1).reshape(-1)            # step-major: step s = row s of each rank
    seg = [order[offsets[r]:offsets[r + 1]] for r in rows_seq]
    new_off = np.concatenate([[0], np.cumsum([len(x) for x in seg])]).astype(np.int64)
    pos = np.arange(len(rows_seq))
    return np.concatenate(seg), new_off, pos // W, pos % W


# ----------------------------------------------------------------------------- metrics
def path_metrics(lens, mc, k, order, offsets, step, rank, *, padded: bool) -> dict:
    """Useful fractions, drafter-cost rank imbalance and step mix of one epoch's batching."""
    L = np.asarray(lens, np.int64)[order]
    kk = np.asarray(k, np.int64)[order]
    cut = offsets[:-1]
    n = np.diff(offsets)
    if padded:
        mx = np.maximum.reduceat(L, cut)
        kmax = np.maximum.reduceat(kk, cut)
        computed_tok, slots = int((n * mx).sum()), int((n * np.minimum(kmax, MAX_ANCHORS)).sum())
        rows_L, rows_k = np.repeat(mx, n), np.repeat(kmax, n)       # each row priced at its padded size
        cost = np.add.reduceat(sample_cost(QWEN3_8B, B, rows_L, np.asarray(mc.supervised)[order], rows_k), cut)
    else:
        computed_tok, slots = int(L.sum()), int(kk.sum())
        cost = np.add.reduceat(sample_cost(QWEN3_8B, B, L, np.asarray(mc.supervised)[order], kk), cut)
    keep = step >= 0
    return {"useful_target_tokens": float(L.sum()) / computed_tok, "useful_anchor_slots": float(kk.sum()) / slots,
            "rank_imbalance": metrics.rank_imbalance(cost[keep], step[keep], rank[keep], W),
            "step_mix": metrics.step_mix(lens, order, offsets, step, edges=class_edges(lens))}


def _timed(fn, repeats: int):
    out, walls, cpus = None, [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return out, statistics.median(walls), statistics.median(cpus)


def run_input(name: str, lens, mc, T: int, repeats: int) -> list[dict]:
    """The three paths on one input: epochs 0 and 1, metrics of epoch 0 (+ repeat pairs 0 -> 1)."""
    lens = np.asarray(lens)
    opts = DrafterOptions(cost_model=QWEN3_8B, block_size=B, max_anchors=MAX_ANCHORS)
    from dflash_prep.objectives.anchors import anchor_counts

    k = anchor_counts(mc.anchor_candidates, mc.supervised, MAX_ANCHORS)
    n = len(lens)
    rows = []
    # (a) recipe
    ep = [recipe_epoch(lens, k, e) for e in (0, 1)]
    _, wall, cpu = _timed(lambda: recipe_epoch(lens, k, 2), repeats)
    o, off = ep[0]
    m = (len(off) - 1) // W * W
    step = np.where(np.arange(len(off) - 1) < m, np.arange(len(off) - 1) // W, -1)
    rows.append({"path": "(a) recipe: random pairs, padded", **path_metrics(lens, mc, k, o, off, step,
                 np.arange(len(off) - 1) % W, padded=True),
                 "repeat_pair_rate": metrics.repeat_pair_rate(*ep[0], *ep[1], n), "pack_wall_s": wall,
                 "pack_cpu_s": cpu})
    # (b) multipack
    static, wall_rows, cpu_rows = _timed(lambda: multipack_rows(lens, T), 1)
    ep = [multipack_epoch(static, lens, e) for e in (0, 1)]
    _, wall, cpu = _timed(lambda: multipack_epoch(multipack_rows(lens, T), lens, 2), repeats)
    o, off, step, rank = ep[0]
    rows.append({"path": "(b) multipack: FFD rows + LPT", **path_metrics(lens, mc, k, o, off, step, rank,
                                                                           padded=False),
                 "repeat_pair_rate": metrics.repeat_pair_rate(ep[0][0], ep[0][1], ep[1][0], ep[1][1], n),
                 "pack_wall_s": wall, "pack_cpu_s": cpu})
    # (c) ours
    src = lengths_mod.LengthSource(lens.astype(np.int32), "lengths", name, fingerprint_array(lens.astype(np.int32)))
    plan = Plan(data=src.describe(), boundaries=(), budget=Budget(value=T), seed=0).with_fingerprint()
    cfg = PackConfig(world_size=W, objective="dflash", options=opts)
    edges = class_edges(lens)
    res = [pack.build_epoch(lens, plan, cfg, e, edges, mask_counts=mc) for e in (0, 1)]
    _, wall, cpu = _timed(lambda: pack.build_epoch(lens, plan, cfg, 2, edges, mask_counts=mc), repeats)
    s = res[0].header["summary"]
    rp = pack.repeat_pair_rate(res[0].arrays["microbatches"], res[0].arrays["sample_ids"],
                               res[1].arrays["microbatches"], res[1].arrays["sample_ids"], n)
    rows.append({"path": "(c) ours: pack --objective dflash", "useful_target_tokens": s["useful_target_tokens"],
                 "useful_anchor_slots": s["useful_anchor_slots"], "rank_imbalance": s["rank_imbalance"],
                 "step_mix": s["step_mix"], "repeat_pair_rate": rp, "pack_wall_s": wall, "pack_cpu_s": cpu,
                 "token_fill": s["token_fill"], "anchor_fill": s["anchor_fill"]})
    for r in rows:
        r["input"] = name
    return rows


def scale_child(n: int) -> None:
    """One epoch of ours at ``n`` seedlike samples, in this (fresh) process: prints a JSON
    line with wall and CPU seconds of :func:`pack.build_epoch` and the peak RSS."""
    import json
    import resource

    lens, mc = seedlike_inputs(n)
    lens32 = lens.astype(np.int32)
    src = lengths_mod.LengthSource(lens32, "lengths", f"seedlike {n}", fingerprint_array(lens32))
    plan = Plan(data=src.describe(), boundaries=(), budget=Budget(value=65536), seed=0).with_fingerprint()
    cfg = PackConfig(world_size=W, objective="dflash", options=DrafterOptions(cost_model=QWEN3_8B))
    edges = class_edges(lens)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t, c = time.perf_counter(), time.process_time()
    res = pack.build_epoch(lens, plan, cfg, 0, edges, mask_counts=mc)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    with tempfile.TemporaryDirectory(prefix="bench-drafter-scale-") as tmp:     # hash and write, as pack does
        t = time.perf_counter()
        manifest.write(Path(tmp) / "epoch-0000", res.header, res.arrays)
        write = time.perf_counter() - t
    s = res.header["summary"]
    print(json.dumps({"n": n, "wall_s": wall, "cpu_s": cpu, "write_s": write,
                      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "inputs_rss_gib": before / 2**20, "rank_imbalance": s["rank_imbalance"],
                      "step_mix": s["step_mix"]}))


def scale_runs(sizes: list[int]) -> list[dict]:
    """:func:`scale_child` for each size in a fresh subprocess (so peak RSS is its own)."""
    import json
    import subprocess
    import sys

    out = []
    for n in sizes:
        r = subprocess.run([sys.executable, "-m", "dflash_prep.bench.drafter_data", "--scale-child", str(n)], check=True,
                           capture_output=True, text=True)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def report(rows: list[dict]) -> str:
    cols = ("useful_target_tokens", "useful_anchor_slots", "rank_imbalance", "repeat_pair_rate", "step_mix",
            "pack_wall_s", "pack_cpu_s")
    out = ["| input | path | useful tokens | useful anchor slots | rank imbalance W=8 | repeat-pair | step mix | "
           "pack s/epoch (wall / CPU) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = [f"{r[c]:.4f}" for c in cols[:5]]
        out.append(f"| {r['input']} | {r['path']} | " + " | ".join(v) + f" | {r['pack_wall_s']:.2f} / {r['pack_cpu_s']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=902_087, help="seedlike samples")
    ap.add_argument("--demo-n", type=int, default=20_000, help="demo chats (0 skips the demo input)")
    ap.add_argument("--repeats", type=int, default=3, help="timed epochs per path (median)")
    ap.add_argument("--out", type=Path, default=None, help="folder for drafter_data.json (default: a temp folder)")
    ap.add_argument("--scale", default="", help="also time ours at these sample counts, e.g. 10000000,30000000")
    ap.add_argument("--scale-child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.scale_child:
        return scale_child(a.scale_child)
    out = a.out or Path(tempfile.mkdtemp(prefix="bench-drafter-"))
    lens, mc = seedlike_inputs(a.n)
    rows = run_input(f"seedlike {a.n:,}", lens, mc, 65536, a.repeats)
    if a.demo_n:
        with tempfile.TemporaryDirectory() as work:
            dl, dmc = demo_inputs(a.demo_n, Path(work))
            rows += run_input(f"demo {a.demo_n:,}", dl, dmc, 4096, a.repeats)
    print(report(rows))
    scale = scale_runs([int(x) for x in a.scale.split(",") if x]) if a.scale else []
    for r in scale:
        print(f"scale {r['n']:,}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, then {r['write_s']:.1f} s to hash and "
              f"write the manifest; peak RSS {r['peak_rss_gib']:.2f} GiB "
              f"({r['inputs_rss_gib']:.2f} GiB before packing), rank imbalance {r['rank_imbalance']:.4f}, "
              f"step mix {r['step_mix']:.3f}")
    atomic_write_json(out / "drafter_data.json", {"rows": rows, "scale": scale, "argv": vars(a) | {"out": str(out)}},
                      format="dflash-prep/bench-drafter-data", version=1)
    print(f"\nwritten {out / 'drafter_data.json'}")


if __name__ == "__main__":
    main()

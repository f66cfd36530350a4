"""``dflash-prep extract --node-rank i --num-nodes N``: one states cache built by N machines at
once, each node writing its share of the shards into the same folder on shared storage.

**The share** (:func:`node_share`). The shard plan (:func:`dflash_prep.formats.states.plan_shards`)
does not depend on N, so neither does any shard file: node i builds shard k exactly as a single
engine would, and the cache is complete when every shard of the plan is in place, whoever wrote
it. Node i's share is a contiguous run of shards cut by tokens: shard k, holding ``t_k`` tokens
with ``c_k`` tokens before it (``T`` in all), goes to node ``floor(N (c_k + t_k / 2) / T)``, the
node whose ``1/N`` of the tokens holds the shard's middle token. Why contiguous and by tokens:

- each node reads one contiguous run of sample ids, so only its part of the tokenized dataset
  (its Arrow files) is read from the shared storage, and its shards sit together in the folder;
- by tokens, not by count: every shard but the last holds about ``--shard-mb`` of states, but a
  short last shard, or a sample longer than ``--shard-mb`` alone in its shard, would unbalance a
  split by count; cut at token quantiles, a node's share differs from ``T / N`` by at most half a
  shard at each of its two cuts (:func:`shard_owners`; ``tests/engine/test_nodes.py``);
- a pure function of the plan's token counts and N: every node computes the same split, with
  nothing to exchange. With fewer shards than nodes, some nodes have nothing to do.

**Concurrent nodes, one folder.** No node overwrites or deletes what another writes:

- a lock per node: ``.CACHE.node-i-of-N.lock`` beside the folder (one node, N = 1:
  ``.CACHE.lock``, as a single build always took), so the same node started twice fails at once.
  After taking it, a node refuses to go on while a node of another ``--num-nodes`` whose share
  overlaps its own holds its lock (e.g. a plain ``extract`` run to finish the cache while node 1
  still builds). These are ``flock`` locks: across machines as far as the shared file system
  carries them (NFS does; Lustre mounted with ``-o flock``);
- a node removes the leftovers of its own shards only (:func:`remove_debris`: the temps of shard
  files and worker inputs of its share, the spool folders of nodes whose share overlaps its own),
  never another node's in flight;
- ``states.json`` is created only when absent (:func:`dflash_prep.formats.fileio.atomic_create_json`):
  the first node's header stays; every other node compares it (fingerprint, plan, engine arguments,
  engine version and ``--batch-tokens``) and refuses in one line when it was started with other options;
- each node's engine log is its own, ``extract.node-i-of-N.log`` (:func:`log_name`).

**Completion.** A node that has built its share reads the shard headers of the whole plan: when
every shard is there it writes the complete ``states.json`` (the shard table is read from the
shards, so two nodes finishing at once write the same file); otherwise it reports how many are
present and which node ranks' shards are missing (:func:`progress_line`). Any node's rerun, a
plain ``extract`` (N = 1) over the folder, or ``dflash-prep verify`` finishes or checks it; a
node's rerun builds only the shards of its share that are not in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.outputs import is_temp_name, lock, remove, stale_of
from dflash_prep.formats.states import LOG_FILE, index_ranges


def check_node(node_rank: int, num_nodes: int) -> None:
    """Refuse a node rank outside ``0..num_nodes - 1`` (one line)."""
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ConfigError(f"--node-rank must be in 0..--num-nodes - 1 and --num-nodes >= 1, got --node-rank "
                          f"{node_rank} --num-nodes {num_nodes}")


def shard_tokens(plan: Sequence[tuple[int, int]], lengths) -> np.ndarray:
    """``(len(plan),)`` int64: the tokens of each shard of ``plan`` (sample-id ranges) under ``lengths``."""
    cum = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.asarray(lengths, np.int64), out=cum[1:])
    return np.array([cum[b] - cum[a] for a, b in plan], np.int64)


def shard_owners(tokens, num_nodes: int) -> np.ndarray:
    """``(len(tokens),)`` int64: the node rank that builds each shard (module docstring): shard k
    goes to ``floor(N (2 c_k + t_k) / (2 T))``, in exact integer arithmetic, so the owners are
    non-decreasing in k (each share contiguous) and a pure function of the token counts and N.
    Shards of no tokens at all are split by count."""
    t = np.asarray(tokens, np.int64)
    if int(num_nodes) < 1:
        raise ConfigError(f"--num-nodes must be >= 1, got {num_nodes}")
    if t.size and int(t.sum()) == 0:
        t = np.ones_like(t)
    before = np.concatenate([[0], np.cumsum(t)[:-1]]) if t.size else t
    total = int(t.sum())
    mid2 = 2 * before + t                                         # twice the middle token's position
    return np.minimum(int(num_nodes) * mid2 // max(2 * total, 1), int(num_nodes) - 1).astype(np.int64)


def node_share(tokens, node_rank: int, num_nodes: int) -> list[int]:
    """The shard indices node ``node_rank`` of ``num_nodes`` builds (ascending, contiguous; empty when
    there are fewer shards than nodes): disjoint between nodes, together every shard exactly once.
    ``tokens``: the tokens of each shard of the plan (:func:`shard_tokens`)."""
    check_node(node_rank, num_nodes)
    return [int(k) for k in np.flatnonzero(shard_owners(tokens, num_nodes) == node_rank)]


def node_tag(node_rank: int, num_nodes: int) -> str:
    return f"node-{node_rank}-of-{num_nodes}"


def log_name(node_rank: int, num_nodes: int) -> str:
    """The engine log of a node in the cache folder (one node: ``extract.log``, as always)."""
    return LOG_FILE if num_nodes == 1 else f"extract.{node_tag(node_rank, num_nodes)}.log"


def spool_prefix(node_rank: int, num_nodes: int) -> str:
    """The name of a build's temp spool folder in the cache, up to its pid (which follows)."""
    return ".spool." if num_nodes == 1 else f".spool-{node_tag(node_rank, num_nodes)}."


def lock_target(out: Path, node_rank: int, num_nodes: int) -> Path:
    """The path whose :func:`~dflash_prep.formats.outputs.lock` a node holds: the cache itself for
    one node (``.CACHE.lock``), else ``CACHE.node-i-of-N`` beside it (``.CACHE.node-i-of-N.lock``)."""
    return out if num_nodes == 1 else out.parent / f"{out.name}.{node_tag(node_rank, num_nodes)}"


_LOCK = r"^\.{name}(?:\.node-(?P<rank>\d+)-of-(?P<num>\d+))?\.lock$"
_SHARD_TMP = re.compile(r"^\.(?:shard-(?P<shard>\d+)\.states|in-(?P<input>\d+))\.\d+\.\w{8}\.tmp$")
_SPOOL_TMP = re.compile(r"^\.spool(?:-node-(?P<rank>\d+)-of-(?P<num>\d+))?\.\d+\.\w{8}\.tmp$")


def _holder(lock_file: Path) -> str | None:
    """What ``lock_file`` says of its holder (``pid P on HOST``) when a live process holds it, else None."""
    try:
        fd = os.open(lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _overlaps(tokens, mine: set[int], rank: int, num: int) -> bool:
    owners = shard_owners(tokens, num)
    return any(int(owners[k]) == rank for k in mine)


def _check_others(out: Path, tokens, node_rank: int, num_nodes: int) -> None:
    """Refuse while a node of another ``--num-nodes`` whose share overlaps this node's holds its lock."""
    mine = set(node_share(tokens, node_rank, num_nodes))
    rx = re.compile(_LOCK.format(name=re.escape(out.name)))
    for f in sorted(out.parent.iterdir()):
        m = rx.match(f.name)
        if not m:
            continue
        rank, num = (int(m["rank"]), int(m["num"])) if m["rank"] is not None else (0, 1)
        if (rank, num) == (node_rank, num_nodes) or num < 1 or not _overlaps(tokens, mine, rank, num):
            continue
        who = _holder(f)
        if who is not None:
            them = "a single-node extract" if num == 1 else f"node {rank} of {num}"
            raise ConfigError(f"{out} is being built by {them} ({who}), whose shards overlap those of node "
                              f"{node_rank} of {num_nodes}; start every node with the same --num-nodes, and finish "
                              "or verify the cache once they are done")


def remove_debris(out: Path, tokens, node_rank: int, num_nodes: int) -> None:
    """Delete what killed builds of this node's share left in ``out`` (module docstring); one node
    (N = 1) owns the folder and deletes every temp in it, as a single build always did. Called under
    :func:`node_lock`, once the folder's header is known to be of this build (a node started with
    another ``--shard-mb`` has another plan, and its share's indices name other nodes' shards): no
    live writer owns any of it."""
    if not out.is_dir():
        return
    if num_nodes == 1:
        remove(p for p in stale_of(out, inside=True) if p.exists())
        return
    mine = set(node_share(tokens, node_rank, num_nodes))
    gone = []
    for f in out.iterdir():
        m = _SHARD_TMP.match(f.name)
        if m and int(m["shard"] or m["input"]) in mine:
            gone.append(f)
            continue
        m = _SPOOL_TMP.match(f.name)
        if m:
            rank, num = (int(m["rank"]), int(m["num"])) if m["rank"] is not None else (0, 1)
            if num >= 1 and _overlaps(tokens, mine, rank, num):
                gone.append(f)
    remove(gone)


@contextlib.contextmanager
def node_lock(out: Path, tokens, node_rank: int, num_nodes: int) -> Iterator[None]:
    """Hold node ``node_rank``'s lock of the cache ``out`` for the ``with`` body, after refusing to
    run beside an overlapping node of another N (module docstring)."""
    with lock(lock_target(out, node_rank, num_nodes)):
        _check_others(out, tokens, node_rank, num_nodes)
        yield


def only_temps(out: Path) -> bool:
    """Whether the folder ``out`` holds nothing but temp names (another node's work that has not
    published anything yet counts as an empty folder)."""
    return all(is_temp_name(f.name) for f in out.iterdir())


def missing_by_node(missing: Sequence[int], tokens, num_nodes: int) -> dict[int, list[int]]:
    """``{node rank: [shard, ...]}`` of the missing shards, by the owners under ``num_nodes``."""
    owners = shard_owners(tokens, num_nodes)
    out: dict[int, list[int]] = {}
    for k in missing:
        out.setdefault(int(owners[k]), []).append(int(k))
    return out


def progress_line(s: dict, out) -> str:
    """The line a node prints when its share is done and the cache is not complete yet: its own
    work, how much of the whole is in place, which node ranks' shards are missing and how to
    finish (``s``: :func:`dflash_prep.engine.extract.extract`'s summary)."""
    miss = s["missing"]
    who = "; ".join(f"node {r}: shard(s) {index_ranges(ks)}" for r, ks in sorted(miss.items()))
    n_missing = sum(len(ks) for ks in miss.values())
    return (f"node {s['node_rank']} of {s['num_nodes']}: its share is in place ({s['shards_written']} of its "
            f"{s['share']} shard(s) written now); {out} holds {s['present']} of {s['shards']} shards, {n_missing} "
            f"missing ({who}). Run those nodes (`{s['command']} --node-rank R --num-nodes {s['num_nodes']}`); the "
            "last node to finish completes the cache, or rerun any node's command after them")


def node_report(node_rank: int, num_nodes: int, tokens, present, written: int) -> dict:
    """A node's part of ``extract``'s summary: its rank, its share's size, the shards it wrote now,
    the shards of the plan in place (``present``: their indices), whether that is all of them, and
    the missing ones by owner under ``num_nodes`` (:func:`missing_by_node`)."""
    have = {int(k) for k in present}
    missing = [k for k in range(len(tokens)) if k not in have]
    return {"node_rank": node_rank, "num_nodes": num_nodes, "share": len(node_share(tokens, node_rank, num_nodes)),
            "shards_written": written, "present": len(have), "complete": not missing,
            "missing": missing_by_node(missing, tokens, num_nodes)}

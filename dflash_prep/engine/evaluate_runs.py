"""The engine runs of ``dflash-prep evaluate`` (:mod:`dflash_prep.engine.evaluate`, steps 4-7).

:func:`run_base` is the one engine without speculation (every set's first turns, then the second
turns of multi-turn sets after the target's own complete first answers); :func:`run_export` is one
export's engine with speculation over every set, compared with the base rows (:func:`compare_runs`),
then our evaluator on the same prompts, giving the report's ``exports[i]`` entry; :func:`run_baseline`
the same for a speculator with no drafter (``--baseline``: no load report, no evaluator of ours),
giving ``baselines[j]``; :func:`run_engines` all of them in order. Both decode through
:func:`decode_all`: one request at a time on ``/v1/completions``, the spec-decode counters read
before and after each.

Lengths are checked before any engine starts (:func:`check_lengths`): every first turn, and every
second turn as far as it is known then, with room for the largest ``k + 1`` (vLLM drafts fewer
tokens near the length limit, which would change tau).

Failures say what failed: an engine that does not start, or refuses an export's load, is diagnosed
as a load (:func:`~dflash_prep.engine.load_check.refusal`, with what the export's files say); a
request that fails once the engine serves is a :class:`RequestFailed` naming the engine, the set and
the prompt, and a timeout as a timeout. :func:`run_engines` hands what completed to its caller
before the error goes on (:class:`Progress`, :func:`partial_facts`): the report is written partial.
"""

from __future__ import annotations

import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from dflash_prep.engine.load_check import read_load_report, refusal, strict_load, strict_message
from dflash_prep.engine.load_report import ENV_VAR as LOAD_REPORT_VAR
from dflash_prep.engine.method import Method
from dflash_prep.engine.ours import compare_ours, decode_ours
from dflash_prep.engine.prompt_sets import REENCODE_SLACK, first_answer_cap
from dflash_prep.engine.vllm_server import SpecCounters, VllmServer, is_cpu_build, vllm_server
from dflash_prep.errors import ConfigError, EngineError

SPEEDUP_NOTE = ("CPU and a toy target: per-step engine overhead dominates, so fewer steps look faster; this ratio says "
                "nothing about serving on a GPU")


# ----------------------------------------------------------------------------- decoding through vLLM
GENERATED = "vllm:generation_tokens_total"
"""vLLM's count of tokens generated, recorded in the same step's stats as its spec-decode counters."""
SETTLE_S = 2.0
"""The longest wait, after a response, for the counters to hold its tokens (:func:`_settled`)."""
TIMED_OUT = 0.95
"""A request that failed after this share of the request timeout or more timed out."""


class RequestFailed(EngineError):
    """A request that failed while the engine was serving (not a failed start or load):
    ``timed_out`` when it outlasted the request timeout."""

    def __init__(self, where: str, error: EngineError, seconds: float, timeout_s: float | None):
        self.timed_out = timeout_s is not None and seconds >= TIMED_OUT * timeout_s
        if self.timed_out:
            msg = (f"{where}: no answer within --timeout {timeout_s:g} s, a request timeout while the engine "
                   f"was serving (it had started and loaded); raise --timeout or lower --max-tokens ({error})")
        else:
            msg = f"{where}: the request failed after {seconds:.1f} s while the engine was serving: {error}"
        super().__init__(msg)


@dataclass(frozen=True)
class _Read:
    counters: SpecCounters
    generated: int | None


def _generated(server: VllmServer) -> int | None:
    """``vllm:generation_tokens_total`` summed over its series; None where the server exports none
    (or is an in-process double with counters only)."""
    if not hasattr(server, "get"):
        return None
    total, seen = 0.0, False
    for line in server.get("/metrics").decode("utf-8", "replace").splitlines():
        if line.startswith(GENERATED) and line[len(GENERATED):len(GENERATED) + 1] in (" ", "{"):
            total, seen = total + float(line.rsplit(None, 1)[-1]), True
    return int(total) if seen else None


def _read(server: VllmServer) -> _Read:
    generated = _generated(server)        # first: the spec-decode counters read after it are as new
    return _Read(server.metrics(), generated)


def _settled(server: VllmServer, since: _Read | None = None, new_tokens: int = 0, *, tries: int = 20) -> _Read:
    """The counters once they hold the last response: vLLM's front end records a step's stats as it
    processes that step's outputs, which may be after the response went out. Where the server
    counts generated tokens, wait (up to :data:`SETTLE_S`) until ``new_tokens`` more than ``since``
    are counted; then until two reads 50 ms apart agree (a counter-only engine: this alone)."""
    now = _read(server)
    deadline = time.monotonic() + SETTLE_S
    while (since is not None and since.generated is not None and now.generated is not None
           and now.generated - since.generated < new_tokens and time.monotonic() < deadline):
        time.sleep(0.02)
        now = _read(server)
    for _ in range(tries):
        time.sleep(0.05)
        again = _read(server)
        if again == now:
            return now
        now = again
    return now


def _post(server: VllmServer, body: dict, where: str) -> tuple[dict, float]:
    """``/v1/completions`` with ``body``: the answer and its seconds; a failure as :class:`RequestFailed`."""
    t0 = time.perf_counter()
    try:
        r = server.post("/v1/completions", body)
    except EngineError as e:
        raise RequestFailed(where, e, time.perf_counter() - t0, getattr(server, "timeout_s", None)) from None
    return r, time.perf_counter() - t0


def decode_all(server: VllmServer, prompts: list[list[int]], cfg, *, spec: bool, first_seed: int = 0,
               max_tokens: int | None = None, where: str = "vLLM") -> tuple[list[dict], SpecCounters]:
    """Every prompt through ``/v1/completions``, one request at a time, each with at most
    ``max_tokens`` new tokens (None: ``cfg.max_tokens``); per prompt: the new token ids, seconds,
    the prompt echo check and (``spec``) the counters' deltas; and the counters' delta over all of
    them. Prompt i is sampled with seed ``cfg.seed + first_seed + i`` (``cfg``: an
    :class:`~dflash_prep.engine.evaluate.EvaluateConfig`); a failed request is a
    :class:`RequestFailed` naming ``where`` and the prompt."""
    rows = []
    first = last = _settled(server) if spec else None
    for i, ids in enumerate(prompts):
        body = {"model": server.model, "prompt": ids, "max_tokens": max_tokens or cfg.max_tokens,
                "temperature": cfg.temperature, "seed": cfg.seed + first_seed + i, "return_token_ids": True}
        r, dt = _post(server, body, f"{where}, prompt {first_seed + i + 1}")
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
            after = _settled(server, last, len(tokens))
            d = after.counters - last.counters
            row["counters"] = d.to_dict()
            row["tau"] = d.tau
            last = after
        rows.append(row)
    return rows, (last.counters - first.counters) if spec else SpecCounters()


# ----------------------------------------------------------------------------- one engine
@contextlib.contextmanager
def _engine(target: Path, cfg, logs: Path, *, name: str, spec_config: dict | None = None,
            method: Method | None = None, export: Path | None = None,
            warm_up: Callable[[VllmServer], None] | None = None) -> Iterator[tuple[VllmServer, dict | None]]:
    """One engine for the run: without speculation (``spec_config`` None), with a speculator that
    needs no model (a baseline), or with the drafter ``export`` (of ``method``): then the server and
    its load report, refused unless strict; the engine's own refusal of an export is diagnosed
    (:func:`~dflash_prep.engine.load_check.refusal`). ``warm_up`` (the first request) belongs to the
    start: an engine that loads an export and then fails its first forward (taps out of range) has
    refused it too."""
    report_file = logs / f"{name}.load-report.json"
    report_file.unlink(missing_ok=True)
    env = {LOAD_REPORT_VAR: str(report_file)} if export else {}
    with contextlib.ExitStack() as stack:
        try:                              # the start and the load: a failure here is the engine's refusal
            server = stack.enter_context(vllm_server(
                target, log=logs / f"{name}.log", speculative_config=spec_config, env=env, timeout_s=cfg.timeout_s,
                max_model_len=cfg.max_model_len, seed=cfg.seed, request_timeout_s=cfg.timeout_s, **cfg.serving()))
            load = read_load_report(report_file, export) if export else None
            if load is not None and not strict_load(load)["ok"]:
                raise EngineError(strict_message(export, strict_load(load)))
            if warm_up is not None:
                warm_up(server)
        except EngineError as e:
            if export is None or str(e).startswith(f"{export}:"):
                raise
            raise refusal(e, export=export, target=target, method=method, report_file=report_file) from None
        yield server, load                # what fails from here on is the run's, said as it is


def _warm_up(server: VllmServer, plan, where: str) -> None:
    """One request before the measured ones, answered and not counted (the counters are read as
    differences from after it): a first request pays one-off costs that would land on the first
    set's tokens/s, the most for vLLM's n-gram proposer, whose numba kernel compiles at its first
    match (the tiny target, 2026-12-07: without it the n-gram row's first set ran at 11 tokens/s, the
    next two at 129 and 165; with it, the first at 179 and the next at 197).
    Its prompt is the first prompt's first 8 ids, 4 times over, so that an n-gram finds a match; the
    counters are settled on it before the first measured request reads them."""
    ids = plan.sets[0].ids[0][:8] * 4
    before = _read(server)
    r, _ = _post(server, {"model": server.model, "prompt": ids, "max_tokens": plan.cfg.max_tokens, "temperature": 0.0,
                          "seed": plan.cfg.seed, "return_token_ids": True}, f"{where}, the warm-up request")
    _settled(server, before, len(((r.get("choices") or [{}])[0]).get("token_ids") or []))


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


# ----------------------------------------------------------------------------- lengths, before any engine
def _margin(plan) -> int:
    """The most tokens one step drafts, plus its bonus token: the room vLLM needs at the length limit."""
    return max(m.k for m in [*plan.methods, *plan.baselines]) + 1


def check_lengths(plan) -> int:
    """Refuse, before any engine starts, a run whose turns do not fit ``--max-model-len`` with the
    room of :func:`_margin` (auto or given: vLLM drafts fewer tokens near the limit, which would
    change tau): every first-turn prompt plus ``--max-tokens``; every second turn as far as it is
    known before the base run: its prompt around an empty first answer, that answer at least
    ``--max-tokens`` (counted :data:`~dflash_prep.engine.prompt_sets.REENCODE_SLACK` times) and
    ``--max-tokens``. Returns the first answers' own cap
    (:func:`~dflash_prep.engine.prompt_sets.first_answer_cap`; 0 when no set has second turns)."""
    cfg, margin = plan.cfg, _margin(plan)
    longest = max(len(p) for s in plan.sets for p in s.ids[:s.first_turn_count()])
    need = longest + cfg.max_tokens + margin
    if need > cfg.max_model_len:
        raise ConfigError(f"the longest prompt ({longest} tokens) plus --max-tokens {cfg.max_tokens} plus the largest "
                          f"k + 1 ({margin}: vLLM drafts fewer tokens near the length limit, which would change tau) "
                          f"is {need} tokens, over --max-model-len {cfg.max_model_len}; raise it to {need} or lower "
                          "--max-tokens")
    floor = max((s.second_turn_floor(plan.tokenizer, plan.enable_thinking) for s in plan.sets if s.multi_turn),
                default=0)
    if not floor:
        return 0
    cap = first_answer_cap(cfg.max_model_len, floor, cfg.max_tokens, margin, cfg.first_answer_tokens)
    if cap < cfg.max_tokens:
        least = floor + (REENCODE_SLACK + 1) * cfg.max_tokens + margin
        raise ConfigError(f"a second turn may need {least} tokens (its prompt around an empty first answer, {floor}; "
                          f"the first answer, {REENCODE_SLACK} x --max-tokens; --max-tokens; the largest k + 1, "
                          f"{margin}), over --max-model-len {cfg.max_model_len}; raise it to {least} (to "
                          f"{least + REENCODE_SLACK * max(0, cfg.first_answer_tokens - cfg.max_tokens)} for complete first "
                          "answers) or lower --max-tokens")
    return cap


# ----------------------------------------------------------------------------- the base engine
REASK_IN_FLIGHT = 8
"""First answers asked again at once (:func:`_first_answers`): they are not measured, so the engine
may batch them (the CPU build serves 8 sequences at a time)."""


def _first_answers(server: VllmServer, s, rows: list[dict], plan, cap: int, where: str) -> tuple[list[dict], int]:
    """Each conversation's first answer for its second turn: the measured row where it ended within
    ``--max-tokens``, else the same prompt asked again (the same seed, unmeasured) under ``cap``, up to
    :data:`REASK_IN_FLIGHT` at once; and how many were asked again."""
    again = [i for i, r in enumerate(rows) if r["finish_reason"] == "length" and cap > plan.cfg.max_tokens]

    def ask(i: int) -> dict:
        (r,), _ = decode_all(server, [s.ids[i]], plan.cfg, spec=False, first_seed=i, max_tokens=cap,
                             where=f"{where}, a first answer asked again under its {cap}-token cap")
        return r

    out = list(rows)
    if again:
        with ThreadPoolExecutor(max_workers=min(REASK_IN_FLIGHT, len(again))) as pool:
            for i, r in zip(again, pool.map(ask, again)):
                out[i] = r
    return out, len(again)


def _base_set(server: VllmServer, s, plan, cap: int, say: Callable[[str], None]) -> list[dict]:
    """One set's rows without speculation: its first turns, then (multi-turn) its second turns
    rendered after the target's own complete first answers (:func:`_first_answers`)."""
    cfg = plan.cfg
    where = f"the engine without speculation on {s.name}"
    rows, _ = decode_all(server, s.ids, cfg, spec=False, where=where)
    if s.multi_turn:
        answers, again = _first_answers(server, s, rows, plan, cap, where)
        second = s.add_second_turns(plan.tokenizer, [a["tokens"] for a in answers], plan.enable_thinking, cap=cap,
                                    truncated=[a["finish_reason"] == "length" for a in answers], asked_again=again)
        cut = s.first_answers["truncated"]
        if cut:
            say(f"warning: {s.name}: {cut} of {len(second)} second turns rest on a first answer cut at its {cap}-token "
                "cap (finish_reason length)" + (", a cut <think>" if plan.enable_thinking else "")
                + (f"; a larger --max-model-len raises the cap, up to --first-answer-tokens {plan.cfg.first_answer_tokens}"
                   if cap < plan.cfg.first_answer_tokens else "; --first-answer-tokens raises it"))
        over = max(len(p) for p in second) + cfg.max_tokens + _margin(plan)
        if over > cfg.max_model_len:
            raise ConfigError(f"{s.name}: a second-turn prompt plus --max-tokens plus the largest k + 1 is {over} "
                              f"tokens, over --max-model-len {cfg.max_model_len} (its first answer re-encoded to more than "
                              f"{REENCODE_SLACK} x its tokens); raise it to {over} or lower --max-tokens")
        more, _ = decode_all(server, second, cfg, spec=False, first_seed=len(rows), where=where)
        rows += more
    return rows


def run_base(plan, logs: Path, say: Callable[[str], None]) -> tuple[dict, dict[str, list[dict]]]:
    """The engine without speculation on every set of ``plan`` (an
    :class:`~dflash_prep.engine.evaluate.Plan`), once :func:`check_lengths` passed: its facts, and
    each set's rows by name."""
    cap = check_lengths(plan)
    base_rows: dict[str, list[dict]] = {}
    say("engine without speculation: starting")
    with _engine(plan.target, plan.cfg, logs, name="base",
                 warm_up=lambda server: _warm_up(server, plan, "the engine without speculation")) as (server, _):
        base_facts = _facts(server)
        say(f"engine without speculation: up in {server.start_s:.1f} s ({server.version})")
        for s in plan.sets:
            rows = base_rows[s.name] = _base_set(server, s, plan, cap, say)
            say(f"  {s.name}: {len(rows)} prompts, {_tps(rows):.1f} tokens/s")
    return base_facts, base_rows


# ----------------------------------------------------------------------------- one export
def _spec_cell(server: VllmServer, s, plan, base: list[dict], version: str, say: Callable[[str], None], *,
               who: str) -> dict:
    """One export on one set with speculation, against the base rows ``base`` (``_total``: the
    set's counters, taken out once our evaluator has compared with them)."""
    greedy = plan.cfg.temperature == 0
    rows, total = decode_all(server, s.ids, plan.cfg, spec=True, where=f"the engine with {who} on {s.name}")
    per_prompt, lossless = compare_runs(rows, base, greedy=greedy)
    echo = [r["same_prompt_tokens"] for r in rows + base]
    said = f"{lossless['equal']}/{lossless['of']}" if greedy else "not claimed"
    say(f"  {s.name}: tau {_fmt(total.tau)}, lossless {said}")
    return {"lossless": lossless,
            "vllm": {"tau": total.tau, **total.to_dict(), "acceptance_per_position": total.acceptance_per_position(),
                     "tokens_per_step": tokens_per_step(per_prompt)},
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
    who = str(export) if export else f"baseline {spec_config.get('method')}"
    with _engine(plan.target, plan.cfg, logs, name=name, spec_config=spec_config, method=method, export=export,
                 warm_up=lambda server: _warm_up(server, plan, f"the engine with {who}")) as (server, load):
        facts = _facts(server)
        say(f"engine with speculation: up in {server.start_s:.1f} s" + (", strict load: yes" if export else ""))
        cells = {s.name: _spec_cell(server, s, plan, base_rows[s.name], facts["version"], say, who=who)
                 for s in plan.sets}
    return facts, load, cells


def _config_facts(config: dict) -> dict:
    return {"speculative_config": config, "speculative_config_json": json.dumps(config, separators=(",", ":"))}


def tokens_per_step(per_prompt: list[dict]) -> float | None:
    """New tokens per forward pass of the target in decoding, over ``per_prompt`` rows: the prefill
    gives each answer's first token and every later step gives one token plus the draft tokens it
    accepted, so ``sum(new - 1) / (sum(new - 1) - accepted)``. A drafter that drafts at every step
    has this equal to its tau; a speculator that drafts only where it finds a match (n-gram, suffix)
    has its tau over the matched steps only, and this is what decoding gains. None without a step."""
    after_first = sum(max(p["new_tokens_spec"] - 1, 0) for p in per_prompt)
    steps = after_first - sum(p["num_accepted_tokens"] for p in per_prompt)
    return after_first / steps if steps > 0 else None


def _pooled(cells: dict) -> dict:
    """The row's ``vllm`` section: the sets' counters (each cell's ``_total``, taken out) added up."""
    totals = [c.pop("_total") for c in cells.values()]
    pooled = totals[0]
    for t_ in totals[1:]:             # (starting from SpecCounters() would lose num_draft_tokens: None + n)
        pooled = pooled + t_
    return {"tau": pooled.tau, **pooled.to_dict(), "acceptance_per_position": pooled.acceptance_per_position(),
            "tokens_per_step": tokens_per_step([p for c in cells.values() for p in c["per_prompt"]])}


# ----------------------------------------------------------------------------- the whole run, and its failure
@dataclass
class Progress:
    """What :func:`run_engines` has completed: the base run, then each export's and baseline's row."""

    logs: Path
    base_facts: dict | None = None
    base_rows: dict[str, list[dict]] | None = None
    exports: list[dict] = field(default_factory=list)
    baselines: list[dict] = field(default_factory=list)

    def engine_facts(self) -> dict:
        """The base engine's facts (the report's ``engine.base``), blank where it never served."""
        blank = {"version": None, "command": None, "start_s": None, "log": str(self.logs / "base.log")}
        return self.base_facts or blank


def run_engines(plan, logs: Path, phases: dict, labels: list[str], *, ours: bool, say: Callable[[str], None],
                after_base: Callable[[], None] | None = None,
                on_failure: Callable[[Progress, BaseException], None] | None = None) -> Progress:
    """Steps 4-7 in order: :func:`run_base` (its seconds to ``phases["base_engine"]``), then
    ``after_base`` (``--save-prompts``: the second turns exist now), each export (``labels[i]``,
    :func:`run_export`) and each baseline (:func:`run_baseline`). On any failure, Ctrl-C included,
    ``on_failure`` gets what completed and the error (to write the report partial,
    :func:`partial_facts`) before the error goes on; a failure of ``on_failure`` itself is said, not
    raised over the run's own."""
    done = Progress(logs)
    try:
        t = time.monotonic()
        done.base_facts, done.base_rows = run_base(plan, logs, say)
        phases["base_engine"] = time.monotonic() - t
        if after_base is not None:
            after_base()
        for i in range(len(plan.exports)):
            done.exports.append(run_export(plan, i, labels[i], done.base_rows, logs, phases, ours=ours, say=say))
        for j in range(len(plan.baselines)):
            done.baselines.append(run_baseline(plan, j, done.base_rows, logs, phases, say=say))
    except (Exception, KeyboardInterrupt) as e:
        if on_failure is not None:
            try:
                on_failure(done, e)
            except Exception as w:
                say(f"note: the partial report was not written ({type(w).__name__}: {w})")
        raise
    return done


def partial_facts(plan, done: Progress, error: BaseException) -> dict:
    """The report's ``partial`` section for a run that stopped on ``error``: the error in one line,
    whether the base run completed, and the exports and baselines completed and not."""
    why = "interrupted (Ctrl-C)" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}"
    return {"partial": {"error": why, "base_run": done.base_rows is not None,
                        "exports_done": [e["path"] for e in done.exports],
                        "exports_not_done": [str(e) for e in plan.exports[len(done.exports):]],
                        "baselines_done": [b["label"] for b in done.baselines],
                        "baselines_not_done": [b.label for b in plan.baselines[len(done.baselines):]]}}

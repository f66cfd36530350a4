"""``dflash-prep evaluate``: exported drafters served by vLLM, with and without speculation, per prompt set.

What it does, in order (:func:`evaluate_exports`); each step's own module says how:

1. **Methods** (:mod:`dflash_prep.engine.method`): each export's ``architectures`` picks vLLM's
   method and ``k`` (``num_speculative_tokens``, ``B - 1`` for a DFlash drafter of block B). Exports
   of different methods (DFlash, EAGLE-3) share one run.
2. **Serving mode** (:mod:`dflash_prep.engine.serving_mode`): ``--thinking on|off|auto`` becomes the
   chat-template kwarg ``enable_thinking`` (auto: the mode the drafters were trained in, from their
   config.json); a line warns when it, or the target's chat template, differs from training.
3. **Prompt sets** (:mod:`dflash_prep.engine.prompt_sets`): shipped benchmarks (``--bench``, a
   deterministic sample of ``--n`` each) and/or the user's ``--prompts FILE``, rendered once, here, by
   the function our evaluator uses, and sent as token ids on ``/v1/completions``; vLLM echoes them
   (``return_token_ids``) and the report checks it.
4. **One engine without speculation** for the whole run: every set's first turns, then the second
   turns of multi-turn sets (MT-Bench), rendered after the target's own first answer.
5. **One engine with speculation per export** (:func:`~dflash_prep.engine.vllm_server.vllm_server` with
   ``--speculative-config``), the strict-load verdict on the report written by our vLLM plugin
   (:mod:`dflash_prep.engine.load_check`; a refused load is diagnosed there too), then every set's
   prompts, one request at a time, with the spec-decode counters read before and after each (per
   prompt, and their change over each set).
6. **Our evaluator** (:mod:`dflash_prep.engine.ours`; ``ours=True``, temperature 0 only): once per
   export on every prompt, with vLLM's stop rule, compared with the counters set by set.

The report (format ``dflash-prep/engine-eval`` v2, written atomically; ``exports[i].sets[<set>]``
is one export on one set, the v1 report's sections: :func:`cell` gives it in v1's shape, printed by
:func:`dflash_prep.engine.report_table.report_rows`): strict load (every export tensor used, no
draft parameter left unloaded), lossless (temperature 0: tokens with speculation == without, per
prompt), tau from the counters (``1 + accepted / drafts``) and the acceptance rate per position,
tokens/s both ways and their ratio (meaningless on CPU, where the target's forward costs next to
nothing), vLLM's version and the exact ``--speculative-config`` JSON, and ``tau_ours`` beside
``tau_vllm`` (pooled over blocks, as the counters pool) with whether they agree within 2 %. Beside
the JSON: ``<out stem>.md`` (tau per drafter and benchmark, the field's layout) and ``<out stem>.png``
(:mod:`dflash_prep.engine.report_plot`), and the engines' logs under ``<out stem>.logs/``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from dflash_prep.engine.load_check import read_load_report, refusal, strict_load, strict_message
from dflash_prep.engine.load_report import ENV_VAR as LOAD_REPORT_VAR
from dflash_prep.engine.method import Method, export_method
from dflash_prep.engine.ours import compare_ours, decode_ours
from dflash_prep.engine.prompt_sets import PromptSet, build_sets, save_prompts
from dflash_prep.engine.prompts import target_tokenizer
from dflash_prep.engine.report_plot import write_plot
from dflash_prep.engine.report_table import markdown_table
from dflash_prep.engine.serving_mode import mode_warnings, resolve_thinking
from dflash_prep.engine.vllm_server import SpecCounters, VllmServer, is_cpu_build, vllm_server
from dflash_prep.errors import ConfigError, EngineError
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json
from dflash_prep.formats.target import read_target_config
from dflash_prep.tokenize.identity import tokenizer_template_sha256

EVAL_FORMAT = "dflash-prep/engine-eval"
EVAL_VERSION = 2
"""v2 (2026-12-06): several exports and prompt sets in one report (``sets``, ``exports[i].sets``);
v1 was one export on one prompt file, its sections at the top level (:func:`cell` gives that shape)."""
DTYPES = ("float32", "bfloat16", "float16", "auto")
THINKING = ("auto", "on", "off")
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
    """Evaluate the first N prompts of ``--prompts FILE`` (0 = all)."""
    n: int = 0
    """Prompts sampled from each shipped benchmark (0 = all of it)."""
    seed: int = 0
    """The benchmarks' sample, and the engine's: request i of a set is sampled with seed + i."""
    timeout_s: float = 600.0
    """Bound on one engine start (and on each request)."""
    max_model_len: int = 0
    """vLLM's ``--max-model-len`` (prompt + new tokens must fit); 0: what the run's longest prompt
    needs (:func:`needed_model_len`), within the target's ``max_position_embeddings``."""
    dtype: str = "float32"
    """vLLM's ``--dtype``. float32 by default: what our evaluator computes in, and what keeps
    greedy outputs equal with and without speculation on the CPU build (docs/engines.md)."""
    thinking: str = "auto"
    """``enable_thinking`` of the chat template: on, off, or auto (the drafters' training mode)."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ConfigError(f"--temperature must be in [0, 10], got {self.temperature}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.thinking not in THINKING:
            raise ConfigError(f"--thinking must be one of {', '.join(THINKING)}, got {self.thinking!r}")
        if self.max_prompts < 0 or self.n < 0 or self.timeout_s <= 0 or self.max_model_len < 0 \
                or self.max_model_len == 1:
            raise ConfigError("--max-prompts and --n must be >= 0, --timeout > 0 and --max-model-len 0 (auto) or >= 2")


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
               spec: bool, first_seed: int = 0) -> tuple[list[dict], SpecCounters]:
    """Every prompt through ``/v1/completions``, one request at a time; per prompt: the new token
    ids, seconds, the prompt echo check and (``spec``) the counters' deltas; and the counters'
    delta over all of them. Prompt i is sampled with seed ``cfg.seed + first_seed + i``."""
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
def _engine(target: Path, cfg: EvaluateConfig, logs: Path, *, method: Method | None, export: Path | None,
            name: str) -> Iterator[tuple[VllmServer, dict | None]]:
    """One engine for the run (``method`` None: without speculation): the server and, with
    speculation, its load report, refused unless strict; the engine's own refusal of an export is
    diagnosed (:func:`~dflash_prep.engine.load_check.refusal`)."""
    spec_config = method.speculative_config(export) if method else None
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
            yield server, load
    except EngineError as e:
        if method is None or str(e).startswith(f"{export}:"):
            raise
        raise refusal(e, export=export, target=target, method=method, report_file=report_file) from None


def _facts(server: VllmServer) -> dict:
    return {"version": server.version, "command": server.command, "start_s": server.start_s, "log": str(server.log)}


def _tps(rows: list[dict]) -> float:
    return sum(len(r["tokens"]) for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)


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


def needed_model_len(target: Path, sets: list[PromptSet], tokenizer, max_tokens: int,
                     enable_thinking: bool | None, *, draft: int = 0) -> tuple[int, int]:
    """(the ``--max-model-len`` the run needs, the target's ``max_position_embeddings``): the longest
    first-turn prompt plus ``max_tokens``; a second turn is bounded by its prompt rendered around an
    empty first answer plus twice ``max_tokens`` (the answer's ids, re-encoded from text, may come back
    longer) plus ``max_tokens``; plus ``draft + 1`` (the most tokens a step drafts, and its bonus:
    vLLM drafts fewer near the length limit, which would change tau), rounded up to 16."""
    from dflash_prep.train.prompts import render_messages

    need = max(len(p) for s in sets for p in s.ids) + max_tokens
    for s in sets:
        for turns in (s.turns or []):
            if len(turns) > 1:
                msgs = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": turns[1]}]
                need = max(need, len(render_messages(tokenizer, msgs, enable_thinking=enable_thinking))
                           + 3 * max_tokens)
    need += draft + 1
    limit = int(read_target_config(target).get("max_position_embeddings") or 0)
    return -(-need // 16) * 16, limit


def cell(res: dict, export: int = 0, name: str | None = None) -> dict:
    """One export on one set (the first set when ``name`` is None) in the v1 report's shape: what
    :func:`~dflash_prep.engine.report_table.report_rows` prints."""
    e = res["exports"][export]
    s = next(x for x in res["sets"] if name is None or x["name"] == name)
    c = e["sets"][s["name"]]
    return {"engine": {"name": res["engine"]["name"], "version": e["engine"]["version"],
                       "speculative_config": e["speculative_config"],
                       "speculative_config_json": e["speculative_config_json"],
                       "spec": e["engine"], "base": res["engine"]["base"]},
            "target": res["target"], "export": {k: e[k] for k in ("path", "architecture", "kind", "block_size",
                                                                 "num_speculative_tokens")},
            "prompts": {"set": s["name"], "path": s.get("path"), "n": s["prompts"],
                        "tokens_fingerprint": s["tokens_fingerprint"], "sent_as": res["prompts_sent_as"],
                        "engine_saw_same_tokens": c["engine_saw_same_tokens"]},
            "sampling": res["sampling"], "strict_load": e["strict_load"], "lossless": c["lossless"],
            "vllm": c["vllm"], "throughput": c["throughput"], "ours": c["ours"], "config": res["config"],
            "per_prompt": c["per_prompt"], "seconds": res["seconds"], "phases_s": res["phases_s"]}


def _labels(exports: list[Path]) -> list[str]:
    """Short distinct names for the table: each folder's name, with its parent's where two clash."""
    names = [e.name for e in exports]
    out = [f"{e.parent.name}/{e.name}" if names.count(e.name) > 1 else e.name for e in exports]
    return [f"{x} ({i + 1})" if out.count(x) > 1 else x for i, x in enumerate(out)]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the evaluation
@dataclass
class Plan:
    """What a run evaluates, settled before any engine starts (:func:`prepare`)."""

    target: Path
    exports: list[Path]
    methods: list[Method]
    tokenizer: object
    sets: list[PromptSet]
    cfg: EvaluateConfig
    """With ``max_model_len`` resolved (never 0)."""
    enable_thinking: bool | None
    requested: str
    """on, off or default (the template's own)."""
    thinking_why: str
    template_sha: str | None
    """The target's chat template's sha256 (what a drafter's config.json records it trained on)."""
    warnings: dict[str, list[str]]
    """Per export: the serving-mode lines (:func:`~dflash_prep.engine.serving_mode.mode_warnings`)."""
    notes: list[str]
    """Lines about the run as a whole (a thinking mode asked of a template without the switch)."""


def prepare(*, target: str | Path, exports: list[str | Path], benches: list[str] = (),
            prompts: str | Path | None = None, num_speculative_tokens: int | None = None, **config) -> Plan:
    """Everything but the engines: each export's method, the serving mode and its warnings, the
    prompt sets' first-turn ids and ``--max-model-len``; every refusal here comes before an engine
    starts, in one line."""
    cfg = EvaluateConfig(**config)
    target = Path(target).resolve()
    exports = [Path(e).resolve() for e in exports]
    if not exports:
        raise ConfigError("pass at least one --export (an exported drafter folder)")
    if len(set(exports)) != len(exports):
        raise ConfigError("the same --export is given twice")
    read_target_config(target)              # an empty or partial config.json: one line, before any engine
    methods = [export_method(e, num_speculative_tokens) for e in exports]
    tok = target_tokenizer(target)
    template_sha = tokenizer_template_sha256(tok)
    enable_thinking, thinking_why = resolve_thinking(cfg.thinking, exports)
    requested = "default" if enable_thinking is None else ("on" if enable_thinking else "off")
    warnings = {str(e): mode_warnings(export_dir=e, requested=requested, template_sha=template_sha) for e in exports}
    sets = build_sets(tok, benches=list(benches), prompts=Path(prompts) if prompts is not None else None, n=cfg.n,
                      max_prompts=cfg.max_prompts, seed=cfg.seed, enable_thinking=enable_thinking)
    need, limit = needed_model_len(target, sets, tok, cfg.max_tokens, enable_thinking,
                                   draft=max(m.k for m in methods))
    if cfg.max_model_len == 0:
        if limit and need > limit:
            raise ConfigError(f"the longest prompt plus --max-tokens needs {need} tokens, over the target's "
                              f"max_position_embeddings {limit}; lower --max-tokens or --n, or drop the longest set")
        cfg = EvaluateConfig(**{**asdict(cfg), "max_model_len": need})
    longest = max(len(p) for s in sets for p in s.ids) + cfg.max_tokens
    if longest > cfg.max_model_len:
        raise ConfigError(f"the longest prompt plus --max-tokens is {longest} tokens, over --max-model-len "
                          f"{cfg.max_model_len}; raise it or lower --max-tokens")
    notes = []
    if enable_thinking is not None and "enable_thinking" not in (getattr(tok, "chat_template", None) or ""):
        notes.append(f"the target's chat template has no enable_thinking switch: thinking {requested} renders the "
                     "same prompts as the template's default")
    return Plan(target, exports, methods, tok, sets, cfg, enable_thinking, requested, thinking_why, template_sha,
                warnings, notes)


def evaluate_exports(*, target: str | Path, exports: list[str | Path], out: str | Path, benches: list[str] = (),
                     prompts: str | Path | None = None, save_prompts_dir: str | Path | None = None,
                     num_speculative_tokens: int | None = None, ours: bool = True,
                     log: Callable[[str], None] | None = _stderr, **config) -> dict:
    """Evaluate every export of ``exports`` on ``target`` in vLLM on the prompt sets ``benches``
    (shipped) and ``prompts`` (a file) (module docstring); ``config``: :class:`EvaluateConfig`'s
    fields. Writes ``out`` (JSON), ``<out stem>.md``, ``<out stem>.png`` and the engines' logs and
    load reports under ``<out stem>.logs/``; ``log`` gets one line per step (None: quiet).
    Returns the report dict."""
    say = log or (lambda _m: None)
    t_start = time.monotonic()
    out = Path(out)
    plan = prepare(target=target, exports=exports, benches=benches, prompts=prompts,
                   num_speculative_tokens=num_speculative_tokens, **config)
    target, exports, methods, tok, sets, cfg = plan.target, plan.exports, plan.methods, plan.tokenizer, plan.sets, plan.cfg
    enable_thinking, template_sha, warnings = plan.enable_thinking, plan.template_sha, plan.warnings
    requested, thinking_why = plan.requested, plan.thinking_why
    for lines in warnings.values():
        for w in lines:
            say(f"warning: {w}")
    for n in plan.notes:
        say(f"note: {n}")
    logs = out.parent / f"{out.stem}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    greedy = cfg.temperature == 0
    say(f"evaluate: {len(exports)} export(s) x {len(sets)} set(s) "
        f"({', '.join(f'{s.name} {len(s.turns or s.ids)}' for s in sets)}), <= {cfg.max_tokens} new tokens, "
        f"temperature {cfg.temperature:g}, thinking {requested} ({thinking_why}); logs: {logs}")
    phases = {"prompts": time.monotonic() - t_start}

    # the base engine: every set's first turns, then the second turns after the target's own answers
    t = time.monotonic()
    base_rows: dict[str, list[dict]] = {}
    say("engine without speculation: starting")
    with _engine(target, cfg, logs, method=None, export=None, name="base") as (server, _):
        base_facts = _facts(server)
        say(f"engine without speculation: up in {server.start_s:.1f} s ({server.version})")
        for s in sets:
            rows, _ = decode_all(server, s.ids, cfg, spec=False)
            if s.multi_turn:
                second = s.add_second_turns(tok, [r["tokens"] for r in rows], enable_thinking)
                over = max(len(p) for p in second) + cfg.max_tokens
                if over > cfg.max_model_len:
                    raise ConfigError(f"{s.name}: a second-turn prompt plus --max-tokens is {over} tokens, over "
                                      f"--max-model-len {cfg.max_model_len}; raise it or lower --max-tokens")
                more, _ = decode_all(server, second, cfg, spec=False, first_seed=len(rows))
                rows += more
            base_rows[s.name] = rows
            say(f"  {s.name}: {len(rows)} prompts, {_tps(rows):.1f} tokens/s")
    phases["base_engine"] = time.monotonic() - t
    saved = [str(p) for p in save_prompts(sets, Path(save_prompts_dir))] if save_prompts_dir is not None else []

    runs = []
    for i, (export, method) in enumerate(zip(exports, methods)):
        t = time.monotonic()
        say(f"engine with {method.architecture} {export} (k = {method.k}): starting")
        cells = {}
        with _engine(target, cfg, logs, method=method, export=export,
                     name="spec" if len(exports) == 1 else f"spec-{i + 1}") as (server, load):
            spec_facts = _facts(server)
            say(f"engine with speculation: up in {server.start_s:.1f} s, strict load: yes")
            for s in sets:
                rows, total = decode_all(server, s.ids, cfg, spec=True)
                per_prompt, lossless = compare_runs(rows, base_rows[s.name], greedy=greedy)
                echo = [r["same_prompt_tokens"] for r in rows + base_rows[s.name]]
                cells[s.name] = {
                    "lossless": lossless,
                    "vllm": {"tau": total.tau, **total.to_dict(),
                             "acceptance_per_position": total.acceptance_per_position()},
                    "throughput": _throughput(rows, base_rows[s.name], spec_facts["version"]),
                    "engine_saw_same_tokens": None if None in echo else all(echo),
                    "ours": None, "per_prompt": per_prompt, "_total": total}
                said = f"{lossless['equal']}/{lossless['of']}" if greedy else "not claimed"
                say(f"  {s.name}: tau {_fmt(total.tau)}, lossless {said}")
        phases[f"spec_engine_{i + 1}"] = time.monotonic() - t
        t = time.monotonic()
        if not ours:
            for c in cells.values():
                c["ours"] = {"skipped": "--no-ours"}
        elif not greedy:
            for c in cells.values():
                c["ours"] = {"skipped": "temperature > 0: our evaluator decodes greedily"}
        else:
            say(f"our evaluator on {export}: {sum(len(s.ids) for s in sets)} prompts")
            r = decode_ours(target, export, [p for s in sets for p in s.ids], k=method.k, max_tokens=cfg.max_tokens)
            at = 0
            for s in sets:
                c = cells[s.name]
                c["ours"] = compare_ours(r, r["per_prompt"][at:at + len(s.ids)], total=c["_total"],
                                         per_prompt=c["per_prompt"])
                at += len(s.ids)
            phases[f"ours_{i + 1}"] = time.monotonic() - t
        totals = [c.pop("_total") for c in cells.values()]
        pooled = totals[0]
        for t_ in totals[1:]:             # (starting from SpecCounters() would lose num_draft_tokens: None + n)
            pooled = pooled + t_
        runs.append({"label": _labels(exports)[i], "path": str(export), "architecture": method.architecture,
                     "kind": method.kind, "block_size": method.block_size, "num_speculative_tokens": method.k,
                     "speculative_config": method.speculative_config(export),
                     "speculative_config_json": json.dumps(method.speculative_config(export), separators=(",", ":")),
                     "engine": spec_facts, "strict_load": strict_load(load), "warnings": warnings[str(export)],
                     "vllm": {"tau": pooled.tau, **pooled.to_dict(),
                              "acceptance_per_position": pooled.acceptance_per_position()},
                     "sets": cells})
    res = {
        "engine": {"name": "vllm", "version": base_facts["version"], "base": base_facts},
        "target": {"path": str(target), "chat_template_sha256": template_sha},
        "thinking": {"flag": cfg.thinking, "enable_thinking": enable_thinking, "why": thinking_why,
                     "notes": plan.notes},
        "prompts_sent_as": "token ids, /v1/completions",
        "sets": [s.facts() for s in sets],
        "sampling": {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
        "config": asdict(cfg),
        "saved_prompts": saved,
        "exports": runs,
    }
    res["seconds"] = round(time.monotonic() - t_start, 2)
    res["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    atomic_write_json(out, res, format=EVAL_FORMAT, version=EVAL_VERSION)
    full = {"format": EVAL_FORMAT, "version": EVAL_VERSION, **res}
    atomic_write_bytes(out.with_suffix(".md"), markdown_table(full).encode())
    try:
        write_plot(full, out.with_suffix(".png"))
    except ImportError as e:              # matplotlib is a dependency, but a bare GPU image may lack it
        say(f"note: no picture ({e}); the table is in {out.with_suffix('.md')}")
    return full


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _throughput(spec_rows: list[dict], base_rows: list[dict], version: str) -> dict:
    spec_tps, base_tps = _tps(spec_rows), _tps(base_rows)
    return {"spec_tokens_per_s": spec_tps, "base_tokens_per_s": base_tps,
            "speedup": spec_tps / base_tps if base_tps else None,
            "new_tokens_spec": sum(len(r["tokens"]) for r in spec_rows),
            "new_tokens_base": sum(len(r["tokens"]) for r in base_rows),
            "note": SPEEDUP_NOTE if is_cpu_build(version) else None}


def evaluate_export(*, target: str | Path, export: str | Path, prompts: str | Path, out: str | Path,
                    num_speculative_tokens: int | None = None, ours: bool = True, **config) -> dict:
    """One export on one prompts file: :func:`evaluate_exports` with those, quiet; the report (v2,
    on disk) as that one :func:`cell`, in the v1 report's shape."""
    return cell(evaluate_exports(target=target, exports=[export], out=out, prompts=prompts,
                                 num_speculative_tokens=num_speculative_tokens, ours=ours, log=None, **config))

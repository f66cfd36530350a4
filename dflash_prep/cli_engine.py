"""The CLI's engine commands: ``extract`` (the target's states, with vLLM) and ``evaluate`` (exports
served by vLLM per benchmark), split from :mod:`dflash_prep.cli` to keep one module per group of
commands. :mod:`dflash_prep.cli` registers them on its app with :func:`register` (given its own
``command`` decorator and ``console``, so ``python -m dflash_prep.cli`` registers them on the app it runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

_IO, _OBJ = "Inputs and outputs", "Objective"        # the rich help panels dflash_prep.cli uses
console = None                                         # set by register: dflash_prep.cli's console()


# --- extract (dflash_prep.engine.extract) ---------------------------------------------------
_ENGINE = "Engine (vLLM)"


def extract_cmd(
    data: Annotated[Path, typer.Argument(help="tokenized dataset folder (dflash-prep tokenize), tokenized with the target's tokenizer")],
    target: Annotated[Path, typer.Option(help="the frozen target: a local transformers folder (config.json + safetensors), the trainer's --target", rich_help_panel=_IO)],
    out: Annotated[Path, typer.Option(help="the states cache folder; rerun the same command to finish a stopped build", rich_help_panel=_IO)],
    objective: Annotated[str, typer.Option(help="dflash | dflash2 (the --draft-layers taps; the final state under --loss kl) or eagle3 (three taps + the final state)", rich_help_panel=_OBJ)] = "dflash",
    draft_layers: Annotated[Optional[int], typer.Option(help="dflash/dflash2: the drafter's layers N; its taps are the trainer's rule for N (default: the trainer's default)", rich_help_panel=_OBJ)] = None,
    target_layer_ids: Annotated[Optional[list[int]], typer.Option(help="explicit taps (0-based, each layer's output), repeated, as the trainer's flag", rich_help_panel=_OBJ)] = None,
    loss: Annotated[str, typer.Option(help="dflash/dflash2: kl also stores the final hidden state (the teacher's LM-head input)", rich_help_panel=_OBJ)] = "ce",
    dtype: Annotated[str, typer.Option(help="bf16 | fp8 (e4m3 + a float32 scale per row: half the disk) | fp32 (exact, for checks)", rich_help_panel=_IO)] = "bf16",
    shard_mb: Annotated[float, typer.Option(help="most MiB of states per shard file (the unit written and resumed)", rich_help_panel=_IO)] = 1024.0,
    batch_tokens: Annotated[int, typer.Option(help="most prompt tokens per LLM.generate call (progress and host memory); 1 = one sample a call, its states then a function of the sample alone (vLLM's CPU kernels are not batch-invariant), as the trainer's online target gives with --engine-tokens 1", rich_help_panel=_ENGINE)] = 32768,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM --tensor-parallel-size", rich_help_panel=_ENGINE)] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="vLLM --pipeline-parallel-size", rich_help_panel=_ENGINE)] = 1,
    enable_expert_parallel: Annotated[bool, typer.Option("--enable-expert-parallel", help="vLLM --enable-expert-parallel (MoE targets)", rich_help_panel=_ENGINE)] = False,
    engine_arg: Annotated[Optional[list[str]], typer.Option(help="any other vllm.LLM argument, KEY=VALUE (JSON values), repeated: e.g. gpu_memory_utilization=0.9, dtype=float32", rich_help_panel=_ENGINE)] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the engine to start, and for any one batch; past it, the worker's stacks go to CACHE/extract.log", rich_help_panel=_ENGINE)] = 900.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace a states cache built with other settings", rich_help_panel=_IO)] = False,
    node_rank: Annotated[int, typer.Option(help="this machine's rank among --num-nodes building one cache into the same --out on shared storage", rich_help_panel=_ENGINE)] = 0,
    num_nodes: Annotated[int, typer.Option(help="machines building the cache together, each its share of the same shards (run the same command on each, with its --node-rank); the cache is the same for any number", rich_help_panel=_ENGINE)] = 1,
    engine: Annotated[str, typer.Option(help="local: one engine here (or this node's share with --node-rank); ray: --replicas engines as tasks of a Ray cluster, each building one share (its own GPUs: TP x PP each)", rich_help_panel=_ENGINE)] = "local",
    replicas: Annotated[int, typer.Option(help="--engine ray: how many engine replicas build the cache together", rich_help_panel=_ENGINE)] = 2,
    address: Annotated[Optional[str], typer.Option(help="--engine ray: 'auto' (the cluster `ray start` runs here) or HOST:PORT; unset: a Ray started for this run", rich_help_panel=_ENGINE)] = None,
):
    """Run the target once in vLLM over every sample and store the hidden states a drafter trains on.

    The trainer then reads them instead of running the target, every epoch: `python -m dflash_prep.train --objective dflash --target T --target-engine vllm --states CACHE ...`. Pass the same --objective, --draft-layers or --target-layer-ids and --loss as that run; a cache that lacks what a run reads is refused with the command that builds it. Without a cache, `--target-engine vllm` alone runs the target in vLLM beside the trainer, online (no disk, the target every epoch).

    Size per token: the taps (and the final state) x hidden x 2 bytes in bf16, about half in fp8; analyze and pack print it for your target. vLLM comes from its own venv (make venv-vllm, or $DFLASH_PREP_VLLM_PYTHON); --tensor-parallel-size, --pipeline-parallel-size and --enable-expert-parallel are vLLM's own. A stopped build resumes where it stopped when rerun; `dflash-prep verify CACHE` re-hashes it. Across machines: the same command on each with --node-rank i --num-nodes N, into one folder on shared storage; each node builds its share, and the last to finish completes the cache (docs/states.md#across-machines). Or let Ray place them: --engine ray --replicas N [--address auto].
    """
    from dflash_prep.engine.extract import ExtractConfig, extract, parse_engine_args

    if engine not in ("local", "ray"):
        from dflash_prep.errors import ConfigError

        raise ConfigError(f"--engine must be local or ray, got {engine!r}")

    cfg = ExtractConfig(data=data, target=target, out=out, objective=objective, draft_layers=draft_layers,
                        target_layer_ids=tuple(target_layer_ids or ()), loss=loss, dtype=dtype, shard_mb=shard_mb,
                        batch_tokens=batch_tokens, tensor_parallel_size=tensor_parallel_size,
                        pipeline_parallel_size=pipeline_parallel_size, enable_expert_parallel=enable_expert_parallel,
                        engine_args=parse_engine_args(engine_arg), timeout_s=timeout, overwrite=overwrite,
                        node_rank=node_rank, num_nodes=num_nodes)
    if engine == "ray":
        from dflash_prep.engine.ray_replicas import extract_on_ray

        s = extract_on_ray(cfg, replicas=replicas, address=address, log=typer.echo)
    else:
        s = extract(cfg, progress=True)
    if not s["complete"]:
        from dflash_prep.engine.nodes import progress_line

        typer.echo(progress_line(s, out))
        return
    what = f"taps {s['taps']}" + (" + final" if s["final"] else "")
    head = f"{out} is complete; nothing to do (same data, target and settings)" if s["up_to_date"] else f"wrote {out}"
    if s["num_nodes"] > 1 and not s["up_to_date"]:
        head += f" (node {s['node_rank']} of {s['num_nodes']}: {s['shards_written']} shard(s) now, the cache complete)"
    typer.echo(f"{head}: {s['samples']:,} samples, {s['tokens']:,} tokens, {what}, {s['dtype']} "
               f"({s['bytes_per_token']:,} B/token), {s['bytes'] / 2**20:,.1f} MiB in {s['shards']} shard(s); "
               f"{s['engine']}")


# --- evaluate (dflash_prep.engine) -----------------------------------------------------------
_ENG = "Engine"
_EVALUATE_EPILOG = (
    "Examples (make venv-vllm first; docs/evaluation.md):\n\n"
    "  dflash-prep evaluate --target T --export D --bench gsm8k,humaneval,mt-bench --n 32 --out eval.json\n\n"
    "  dflash-prep evaluate --target T --export ours/ --export public/ --bench all --thinking off --out cmp.json   "
    "(one table: one row per drafter, DFlash and EAGLE-3 alike)\n\n"
    "  dflash-prep evaluate --target T --export D --prompts heldout.jsonl --out eval.json   (your own prompts)\n\n"
    "  dflash-prep evaluate ... --temperature 0.7 --no-ours   (sampled: acceptance only)\n\n"
    "  dflash-prep evaluate --target T --export D --baseline ngram --bench all --out eval.json   (beside vLLM's n-gram "
    "speculator, no training needed; --baseline ngram:k=5,min=2,max=4 for other settings; no --export: the baseline "
    "alone)\n\n"
    "Shipped sets: gsm8k, humaneval, mbpp, mt-bench (two turns, the second after the target's own first answer). "
    "One engine without speculation for the whole run, one with speculation per export. k: a DFlash drafter of block "
    "B is served with num_speculative_tokens = B - 1; EAGLE-3 chains 7. --thinking auto renders with the mode the "
    "drafter was trained in (its config.json), and a line warns when the mode or the target's chat template differs "
    "from training; another when prompts of a set share a 13-token span with the drafters' training data "
    "(--train-data, or each export's provenance). Writes OUT (JSON), OUT_STEM.md (the table), OUT_STEM.png (tau per "
    "set, acceptance per position) "
    "and the engines' logs under OUT_STEM.logs/. The engine runs from .venv-vllm (or $DFLASH_PREP_VLLM_PYTHON); "
    "DFlash2 needs vLLM's V2 model runner (GPU).")


def evaluate_cmd(
    target: Annotated[Path, typer.Option(help="the target model folder (transformers format, with its tokenizer)")],
    out: Annotated[Path, typer.Option(help="report JSON to write; OUT_STEM.md, OUT_STEM.png and the engines' logs (OUT_STEM.logs/) go beside it")],
    export: Annotated[Optional[list[Path]], typer.Option(metavar="DIR", help="an exported drafter folder (python -m dflash_prep.train.export): DFlashDraftModel, DFlash2DraftModel or LlamaForCausalLMEagle3; repeat to compare drafters side by side on one base run")] = None,
    baseline: Annotated[Optional[list[str]], typer.Option(metavar="NAME[:KEY=N,...]", help="a speculator that needs no training, as a row beside the drafters on the same prompts and base run (tau, lossless, tokens/s): ngram (vLLM's prompt lookup; default k=7,min=2,max=4, e.g. ngram:k=5,min=2,max=4) or suffix (suffix decoding, k=24; needs the arctic-inference package in vLLM's venv, which has no CPU build); repeat for several")] = None,
    bench: Annotated[Optional[str], typer.Option(help="shipped prompt sets, comma-separated, or 'all': gsm8k, humaneval, mbpp, mt-bench (docs/evaluation.md: sources, licences, prompt formats)")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help='your own prompts: JSONL of {"messages": [...]} (rendered with the target\'s chat template up to the first assistant turn) or {"prompt": "..."}; a set named after the file')] = None,
    n: Annotated[int, typer.Option("--n", help="prompts sampled from each --bench set, deterministically from --seed (0 = the whole set)")] = 0,
    seed: Annotated[int, typer.Option(help="the --bench sample's seed, and the engine's: request i of a set samples with seed + i")] = 0,
    thinking: Annotated[str, typer.Option(help="the chat template's enable_thinking: on, off, or auto (the mode the drafter was trained in, recorded in its config.json; the template's default when unrecorded)")] = "auto",
    save_prompts: Annotated[Optional[Path], typer.Option(help='write DIR/<set>.jsonl: the exact token ids sent, one {"prompt_token_ids": [...]} a line, to replay in another tool')] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option(help="k for every export: DFlash: default block_size - 1 (vLLM runs the bonus token + k mask queries); EAGLE-3: default 7", rich_help_panel=_ENG)] = None,
    max_tokens: Annotated[int, typer.Option(help="new tokens per prompt, at most (vLLM and our evaluator alike)")] = 64,
    first_answer_tokens: Annotated[int, typer.Option(help="MT-Bench (multi-turn sets): the most new tokens the target's first answer may take before the second turn is asked (FastChat's 1024, as published); a first answer cut by --max-tokens is asked again under this cap, unmeasured, and answers still cut are counted in the report")] = 1024,
    temperature: Annotated[float, typer.Option(help="0: greedy, lossless checked; > 0: sampled, acceptance only")] = 0.0,
    max_prompts: Annotated[int, typer.Option(help="the first N prompts of --prompts FILE (0 = all)")] = 0,
    ours: Annotated[Optional[bool], typer.Option("--ours/--no-ours", help="also run our own evaluator (train/speculate.py, torch, this process, on the CPU in float32) and compare tau per set; default: on for targets up to 1 B parameters (counted from their safetensors), off above with a note")] = None,
    timeout: Annotated[float, typer.Option(help="seconds an engine start (and each request) may take before it is stopped", rich_help_panel=_ENG)] = 600.0,
    max_model_len: Annotated[int, typer.Option(help="vLLM's --max-model-len; 0: what the longest prompt needs, within the target's max_position_embeddings", rich_help_panel=_ENG)] = 0,
    dtype: Annotated[str, typer.Option(help="vLLM's --dtype: auto (float32 on the CPU build, what our evaluator computes in; the engine's own choice on a GPU build), float32, bfloat16 or float16", rich_help_panel=_ENG)] = "auto",
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM --tensor-parallel-size of every engine of the run", rich_help_panel=_ENG)] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="vLLM --pipeline-parallel-size of every engine of the run", rich_help_panel=_ENG)] = 1,
    engine_arg: Annotated[Optional[list[str]], typer.Option(metavar="KEY=VALUE", help="any other vLLM server argument (JSON values), repeated, e.g. gpu_memory_utilization=0.85, max_num_seqs=64, enforce_eager=true; a GPU build serves with vLLM's defaults, the CPU build with enforce_eager=true and max_num_seqs=8, which these replace", rich_help_panel=_ENG)] = None,
    train_data: Annotated[Optional[Path], typer.Option(metavar="DATA", help="the drafters' training data (a dflash-prep tokenize folder) for the contamination check: how many prompts of each set share a --contamination-n-token span with it; default: the data each export's provenance names, when it is still there")] = None,
    contamination_n: Annotated[int, typer.Option(help="tokens a prompt must share with the training data in one span to count as seen (0: no contamination check)")] = 13,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON (without per-prompt rows) instead of tables")] = False,
):
    """Serve exported drafters with vLLM (from .venv-vllm: make venv-vllm) as users would, with and without speculative decoding, on the same prompt token ids, per benchmark. Per drafter and set: strict load (every export tensor used, no draft parameter left unloaded), lossless (temperature 0: outputs equal with and without speculation), tau from vLLM's counters (1 + accepted / drafts, and per position), tokens/s both ways with what they were measured under (engine build, eager or not, dtype, max-num-seqs, parallel sizes, one request at a time), the exact --speculative-config JSON to paste; with --ours (the default up to 1 B target parameters), tau from our own evaluator on the same prompts and whether the two agree within 2 %. One table (rows: drafters, columns: sets) and a picture. --baseline ngram (or suffix) adds a speculator that needs no drafter as a row on the same prompts and base run; with no --export, the baselines alone."""
    import json

    from dflash_prep.engine.evaluate import cell, evaluate_exports
    from dflash_prep.engine.extract import parse_engine_args
    from dflash_prep.engine.report_table import report_rows
    from dflash_prep.evalsets import parse_benchmarks

    benches = parse_benchmarks(bench) if bench else []
    res = evaluate_exports(target=target, exports=export or [], baselines=baseline or [], out=out, benches=benches, prompts=prompts,
                           save_prompts_dir=save_prompts, num_speculative_tokens=num_speculative_tokens, ours=ours,
                           max_tokens=max_tokens, first_answer_tokens=first_answer_tokens, temperature=temperature, max_prompts=max_prompts, n=n, seed=seed,
                           timeout_s=timeout, max_model_len=max_model_len, dtype=dtype, thinking=thinking,
                           tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                           engine_args=parse_engine_args(engine_arg), train_data=str(train_data or ""),
                           contamination_n=contamination_n)
    if json_out:
        slim = {**res, **{key: [{**e, "sets": {k: {kk: vv for kk, vv in c.items() if kk != "per_prompt"}
                                                 for k, c in e["sets"].items()}} for e in res[key]]
                          for key in ("exports", "baselines")}}
        typer.echo(json.dumps(slim, indent=2, allow_nan=False))
        return
    from rich.table import Table

    if len(res["exports"]) == 1 and len(res["sets"]) == 1:     # one drafter on one set: every fact, two columns
        table = Table(show_header=True)
        table.add_column("", no_wrap=True)
        table.add_column(f"vLLM evaluation: {out}", overflow="fold")
        for k, v in report_rows(cell(res)):
            table.add_row(k, v)
        console().print(table)
    _print_tau_tables(res)
    typer.echo(f"report: {out}; table: {out.with_suffix('.md')}; picture: {out.with_suffix('.png')}"
               + (f"; prompts sent: {save_prompts}/" if save_prompts else ""))


def _print_tau_tables(res: dict) -> None:
    """tau per drafter and set, then the per-set details (the report's .md, as terminal tables)."""
    from rich.table import Table

    from dflash_prep.engine.report_table import markdown_table

    def flush(rows: list[list[str]]) -> None:
        if rows:
            # the acceptance per position is in the .md and the picture: without it the table fits 80 columns
            keep = [i for i, h in enumerate(rows[0]) if h != "accepted per position"]
            t = Table(show_header=True, pad_edge=False, padding=(0, 1))
            for i in keep:
                t.add_column(rows[0][i], overflow="fold", no_wrap=i < 2)   # the drafter and set names stay whole
            for r in rows[2:]:                         # rows[1] is the markdown's |---| line
                t.add_row(*[r[i] for i in keep])
            console().print(t)

    rows: list[list[str]] = []
    for line in markdown_table(res).splitlines():      # the markdown's tables as rich tables, its text as is
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
            continue
        flush(rows)
        rows = []
        if line.strip():
            typer.echo(line.lstrip("# "))
    flush(rows)


def register(command, console_fn) -> None:
    """Add ``extract`` and ``evaluate`` to the app whose ``command`` decorator is given."""
    global console
    console = console_fn
    command("extract")(extract_cmd)
    command("evaluate", epilog=_EVALUATE_EPILOG)(evaluate_cmd)

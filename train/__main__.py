"""``python -m dflash_prep.train``: parse options, build a :class:`TrainConfig`, call :func:`dflash_prep.train.loop.train`.

Launch one process per GPU with torchrun (``make train`` does, through
:mod:`dflash_prep.train.launch`, so a user error reads as one line)::

    torchrun --nproc_per_node 8 -m dflash_prep.train --data D --plan P --manifests M --model 100m
    # multi-node: the same on every node, plus torchrun's rendezvous flags, e.g.
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        --rdzv_id RUN -m dflash_prep.train ...

Options override a TOML ``--config`` file, which overrides the defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_prep.errors import DflashError
from dflash_prep.kernels.errors import AttentionError

from .loop import PeerStopped

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main(
    config: Annotated[Optional[Path], typer.Option(help="TOML file of TrainConfig fields ([model] table for the model)")] = None,
    data: Annotated[Optional[str], typer.Option(help="tokenized dataset folder")] = None,
    plan: Annotated[Optional[str], typer.Option(help="plan.json from `dflash-prep analyze`")] = None,
    manifests: Annotated[Optional[str], typer.Option(help="manifest root (epoch-000N folders)")] = None,
    out: Annotated[Optional[str], typer.Option(help="run folder: checkpoint.pt, log.jsonl, summary.json")] = None,
    model: Annotated[Optional[str], typer.Option(help="model preset: tiny or 100m")] = None,
    epochs: Annotated[Optional[int], typer.Option(help="epochs to train")] = None,
    max_steps: Annotated[Optional[int], typer.Option(help="stop after this many optimizer steps (0 = all)")] = None,
    pack_missing: Annotated[Optional[bool], typer.Option(help="pack a missing epoch on the fly")] = None,
    rescale: Annotated[Optional[bool], typer.Option(help="resume a checkpoint of another world size: re-pack the rest of its epoch for this one")] = None,
    lr: Annotated[Optional[float], typer.Option(help="peak learning rate")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option(help="linear warmup steps")] = None,
    grad_clip: Annotated[Optional[float], typer.Option(help="global grad-norm clip (0 = off)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="model init seed")] = None,
    attn: Annotated[Optional[str], typer.Option(help="attention: auto, reference, triton (CPU: interpreter)")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda")] = None,
    bf16: Annotated[Optional[bool], typer.Option(help="bf16 autocast on CUDA")] = None,
    prefetch: Annotated[Optional[int], typer.Option(help="steps the FIFO prefetch thread builds ahead")] = None,
    ckpt_every: Annotated[Optional[int], typer.Option(help="checkpoint every N steps (0 = at the end)")] = None,
    from_scratch: Annotated[Optional[bool], typer.Option("--from-scratch/--resume", help="--resume (default): continue from OUT/checkpoint.pt when present; --from-scratch: ignore it, a new run on the current plan")] = None,
    progress: Annotated[Optional[bool], typer.Option(help="progress bar on rank 0")] = None,
    wandb: Annotated[Optional[str], typer.Option(help="Weights & Biases project (needs wandb installed)")] = None,
    objective: Annotated[Optional[str], typer.Option(help="lm (next-token) or dflash (a drafter on --target)")] = None,
    init_from: Annotated[Optional[str], typer.Option(help="LM: start from this transformers folder; saved to OUT/hf")] = None,
    target: Annotated[Optional[str], typer.Option(help="DFlash: the frozen target, a transformers folder")] = None,
    draft_layers: Annotated[Optional[int], typer.Option(help="DFlash: draft layers N")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="DFlash: block size B")] = None,
    gamma: Annotated[Optional[float], typer.Option(help="DFlash: slot-weight decay (0 = (B-2)/2)")] = None,
    sliding_window: Annotated[Optional[int], typer.Option(help="DFlash: sliding-window draft attention W (0 = full, else >= B)")] = None,
    max_anchors: Annotated[Optional[int], typer.Option(help="DFlash: anchors per sample at most")] = None,
    anchor_policy: Annotated[Optional[str], typer.Option(help="DFlash: cap or density")] = None,
    anchor_seed: Annotated[Optional[int], typer.Option(help="DFlash: anchor seed (-1 = manifest's, else --seed)")] = None,
    mask_token_id: Annotated[Optional[int], typer.Option(help="DFlash: mask token id (-1 = auto)")] = None,
    ce_chunk: Annotated[Optional[int], typer.Option(help="rows per LM-head + CE chunk")] = None,
):
    """Train on the manifests, exactly in manifest order: the small decoder or a transformers LM
    (``--objective lm``), or a DFlash drafter on a frozen target (``--objective dflash``)."""
    from . import config as config_mod

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = config_mod.build(config, data=data, plan=plan, manifests=manifests, out=out, model=model, epochs=epochs,
                               max_steps=max_steps, pack_missing=pack_missing, rescale=rescale, lr=lr, warmup_steps=warmup_steps,
                               grad_clip=grad_clip, seed=seed, attn=attn, device=device, bf16=bf16,
                               prefetch=prefetch, ckpt_every=ckpt_every, from_scratch=from_scratch,
                               progress=progress, wandb=wandb, objective=objective, init_from=init_from,
                               target=target, draft_layers=draft_layers, block_size=block_size, gamma=gamma,
                               sliding_window=sliding_window,
                               max_anchors=max_anchors, anchor_policy=anchor_policy, anchor_seed=anchor_seed,
                               mask_token_id=mask_token_id, ce_chunk=ce_chunk)
        from .loop import train

        s = train(cfg)
    except (DflashError, AttentionError) as e:
        # one line per error: the rank that hit it speaks; ranks that only followed it stay quiet
        if not isinstance(e, PeerStopped):
            msg = " ".join(str(e).split("\n")) if len(str(e).splitlines()) <= 1 else str(e)
            saved = getattr(e, "dflash_saved", None)
            note = f" (progress saved in {saved}; rerun to resume)" if saved else ""
            typer.secho(f"error (rank {rank}): {msg}{note}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except OSError as e:  # disk full, permission denied: the environment, not a bug
        typer.secho(f"error (rank {rank}): {e.filename + ': ' if e.filename else ''}{e.strerror or e}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    if rank == 0:
        tau = f", tau {s['tau_first']:.3f} -> {s['tau_last']:.3f}, {s['anchors_per_s']:,.0f} anchors/s" \
            if s.get("tau_last") is not None else ""
        typer.echo(f"done: {s['steps']} steps (global {s['global_step']}), loss {s['loss_first']:.4f} -> "
                   f"{s['loss_last']:.4f} ({'fell' if s['loss_fell'] else 'did NOT fall'}){tau}, "
                   f"{s['tokens_per_s']:,.0f} real tok/s, efficiency {s['efficiency']:.3f}, "
                   f"data wait {100 * s['data_wait_share']:.1f}%, summary in {Path(cfg.out) / 'summary.json'}"
                   if s["steps"] else f"nothing to do: the run is already at epoch {s['cursor']['epoch']} "
                   f"(global step {s['global_step']}); raise --epochs/--max-steps or pass --from-scratch")


if __name__ == "__main__":
    app()

"""Speculative decoding with a DFlash drafter: mean acceptance length on held-out prompts.

The DFlash inference algorithm at temperature 0, one prompt at a time::

    prefill   the target runs the prompt (KV cache kept); its argmax at the last position is the
              bonus token x_n; the tapped layers' hidden states of the prompt are the context
              features F[0, n)
    repeat    block = [bonus, MASK x (B-1)] at positions start .. start+B-1 (start = n at first)
      draft   the drafter reads the block's embeddings (the target's embed_tokens) and the context
              features F[0, start); the target's lm_head on its last B-1 outputs, argmax, fills
              slots 1..B-1 (one drafter forward per block)
      verify  one target forward over the block (cache holds [0, start)) gives posterior p_i =
              argmax after block[:i+1], i = 0..B-1
      accept  a = length of the matching prefix of block[1:] against p[:-1]; block[:a+1] is
              committed, p[a] is the next bonus; acceptance length = a + 1 (1..B); the target's
              cache is cut back to start + a + 1 and its features of block[:a+1] join the context
    stop      after a block whose committed tokens or next bonus hold a stop token (eos), or once
              max_new_tokens are committed; the output (committed + the last bonus) is cut after
              its first stop token and at max_new_tokens

Every committed token is the target's own argmax given everything before it, so the output
must equal the target's plain greedy decoding ("lossless"): :func:`evaluate` runs that too (one
token per forward, the same KV cache) and compares token for token. A mismatch is reported with
its position; in fp32 it can only come from an argmax near-tie that a block-wide and a
one-token forward round differently.

Semantics match the public reference's ``dflash_generate`` (acceptance length, stop rule,
tau = mean over prompts of each prompt's mean acceptance length, as its benchmark prints);
the difference is only in work: the reference keeps a drafter KV cache of the context, this
loop recomputes the drafter's context keys/values from F[0, start) every block (the same values:
they depend only on the features and positions), which is O(start) per block, fine at demo scale.

The proposer is pluggable (:class:`Proposer`): the export's ``config.json`` ``architectures``
names the objective whose ``decode`` hook loads it (:func:`drafter_of`; DFlash:
:class:`dflash_prep.train.objectives.dflash.decode.DFlashProposer`). An export may offer more than
one proposer (a variant's own decoding beside its base's): the first is the result, the others
are reported under ``variants`` on the same prompts. The tests also drive the loop with an oracle
and an always-wrong proposer to check that acceptance lengths are counted right (B per block
and 1 per block).

    python -m dflash_prep.train.speculate --target DIR --drafter DIR --prompts FILE --out FILE

``--prompts`` is JSONL: ``{"messages": [...]}`` (chat; rendered with the target's chat template
up to, not including, the first assistant turn, with the generation prompt) or
``{"prompt": "text"}`` (raw text, no template). The result is JSON, format
``dflash-prep/speculate-eval`` v1 (see :func:`evaluate`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dflash_prep.errors import ConfigError, DflashError, FormatError
from dflash_prep.formats.fileio import atomic_write_json
from dflash_prep.formats.target import target_identity
from dflash_prep.train.prompts import load_prompts

EVAL_FORMAT = "dflash-prep/speculate-eval"
EVAL_VERSION = 1


# ----------------------------------------------------------------------------- target
class Target:
    """A transformers causal LM used as the frozen target: fp32 on CPU, eval, no grad.

    Holds one sequence's KV cache (a ``DynamicCache``). ``forward(ids, start)`` runs ``ids`` at
    positions ``start..`` on top of a cache that must hold exactly ``start`` positions and
    returns logits ``(T, V)`` and the tapped features ``(T, k*H)``:
    ``cat(hidden_states[l + 1] for l in layer_ids)`` (``hidden_states[0]`` is the embeddings).
    """

    def __init__(self, model, layer_ids: list[int] | tuple[int, ...] = ()):
        self.model = model.eval()
        self.set_layers(layer_ids)
        self.cache = None

        # transformers >= 5.2x names the argument `cache` (`past_key_values` is deprecated there)
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def set_layers(self, layer_ids) -> None:
        """Tap these decoder layers' outputs (0-based)."""
        self.layer_ids = [int(x) for x in layer_ids]
        n = int(self.model.config.num_hidden_layers)
        bad = [x for x in self.layer_ids if not 0 <= x < n]
        if bad:
            raise ConfigError(f"target layer ids {bad} are outside the target's {n} layers")

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(h)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached positions (a negative ``crop``: "remove this many", which
        transformers 4.x and 5.x both read the same way)."""
        extra = self.cache.get_seq_length() - n
        if extra > 0:
            self.cache.crop(-extra)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, start: int, *, feats: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        have = self.cache.get_seq_length()
        if have != start:
            raise RuntimeError(f"target cache holds {have} positions, expected {start}")
        pos = torch.arange(start, start + ids.numel(), device=self.device)[None]  # (1, T)
        out = self.model(input_ids=ids.view(1, -1).to(self.device), position_ids=pos, use_cache=True,
                         output_hidden_states=feats and bool(self.layer_ids), **{self._cache_arg: self.cache})
        f = None
        if feats and self.layer_ids:
            f = torch.cat([out.hidden_states[l + 1][0] for l in self.layer_ids], dim=-1)  # (T, k*H)
        return out.logits[0].float(), f  # (T, V)


# ----------------------------------------------------------------------------- proposers
class Proposer(Protocol):
    block_size: int

    def propose(self, block: torch.Tensor, ctx_feats: torch.Tensor, start: int,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens for slots 1..B-1 ``(B-1,)`` of ``block`` ``(B,)`` (bonus then masks) at
        positions ``start..start+B-1``, given the context features ``(start, k*H)`` and the
        committed tokens ``(start,)`` (a drafter that reads them: EAGLE-3's chain)."""


# ----------------------------------------------------------------------------- decoding
@dataclass
class Decoded:
    tokens: list[int]
    """New tokens after the prompt (cut after the first stop token and at max_new_tokens)."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Per verified block: accepted drafts + 1 (1..B)."""
    seconds: float = 0.0


def _cut(tokens: list[int], stop_ids: set[int], max_new: int) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


@torch.no_grad()
def speculative_generate(target: Target, proposer: Proposer, prompt: list[int], *, max_new_tokens: int,
                         stop_ids: set[int], mask_token_id: int, engine_stop: bool = False) -> Decoded:
    """The loop of the module docstring for one prompt (temperature 0); ``mask_token_id`` fills the
    block's slots before the proposer drafts them (0 for a drafter without one); ``engine_stop``:
    the serving engines' stop rule (module docstring)."""
    t0 = time.perf_counter()
    B = proposer.block_size
    target.reset()
    ids = torch.tensor(prompt, dtype=torch.long)
    logits, feats = target.forward(ids, 0)
    ctx = feats  # (start, k*H)
    out: list[int] = []  # committed tokens after the prompt
    bonus = int(logits[-1].argmax())
    start = len(prompt)
    acc: list[int] = []
    history = list(prompt)  # every committed token
    pending = 1 if engine_stop else 0  # vLLM counts the bonus as emitted: it stops at committed + 1 tokens
    while len(out) + pending < max_new_tokens:  # the reference's loop: `while start < max_length`
        block = torch.full((B,), mask_token_id, dtype=torch.long)  # (B,)
        block[0] = bonus
        if B > 1:
            block[1:] = proposer.propose(block, ctx, start, tokens=torch.tensor(history, dtype=torch.long)).cpu()
        logits, f = target.forward(block, start)
        post = logits.argmax(-1).cpu()  # (B,) target argmax after block[:i+1]
        a = int((block[1:] == post[:-1]).to(torch.int64).cumprod(0).sum())
        acc.append(a + 1)
        committed = [int(t) for t in block[:a + 1]]
        out.extend(committed)
        history.extend(committed)
        bonus = int(post[a])
        start += a + 1
        target.crop(start)
        if f is not None:
            ctx = torch.cat([ctx, f[:a + 1]], dim=0)
        if any(t in stop_ids for t in committed) or bonus in stop_ids:
            break
    out.append(bonus)  # the reference's output ends with the last bonus, then is cut
    return Decoded(_cut(out, stop_ids, max_new_tokens), acc, time.perf_counter() - t0)


@torch.no_grad()
def greedy_generate(target: Target, prompt: list[int], *, max_new_tokens: int, stop_ids: set[int]) -> Decoded:
    """The target alone: one token per forward on its KV cache, argmax (the lossless reference)."""
    t0 = time.perf_counter()
    target.reset()
    logits, _ = target.forward(torch.tensor(prompt, dtype=torch.long), 0, feats=False)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in stop_ids:
        logits, _ = target.forward(torch.tensor(out[-1:]), len(prompt) + len(out) - 1, feats=False)
        out.append(int(logits[-1].argmax()))
    return Decoded(_cut(out, stop_ids, max_new_tokens), [], time.perf_counter() - t0)


# ----------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class EvalConfig:
    """One acceptance evaluation (temperature 0 only: the acceptance rule here is greedy)."""

    max_new_tokens: int = 128
    """New tokens per prompt, at most."""
    max_prompts: int = 0
    """Evaluate the first N prompts (0 = all)."""
    block_size: int = 0
    """Block size B at inference (0 = the drafter's own)."""
    check_lossless: bool = True
    """Also decode each prompt with the target alone and compare token for token."""
    engine_stop: bool = False
    """Stop as serving engines (vLLM) do: no block is verified once the committed tokens and the
    bonus fill max_new_tokens (default: the reference ``dflash_generate`` loop, which verifies one
    more block when the last one ends one token short). The output is the same either way."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_prompts < 0 or self.block_size < 0:
            raise ConfigError("--max-prompts and --block-size must be >= 0")


def summarize(per_prompt: list[dict], block_size: int) -> dict:
    """tau (mean over prompts of each prompt's mean acceptance length, as the reference
    benchmark prints it), the pooled mean over all blocks, and the histogram of lengths 1..B."""
    lens = [x for p in per_prompt for x in p["acceptance_lengths"]]
    taus = [p["tau"] for p in per_prompt if p["acceptance_lengths"]]
    hist = [0] * (block_size + 1)
    for x in lens:
        hist[x] += 1
    return {"tau": sum(taus) / len(taus) if taus else float("nan"),
            "tau_pooled": sum(lens) / len(lens) if lens else float("nan"),
            "blocks": len(lens), "histogram": hist[1:]}


def evaluate(target_dir: str | Path, drafter_dir: str | Path, prompts_file: str | Path | None,
             cfg: EvalConfig = EvalConfig(), *, prompt_ids: list[list[int]] | None = None) -> dict:
    """Speculative decoding of every prompt with the exported drafter; the result dict.

    The prompts are ``prompts_file`` rendered by :func:`~dflash_prep.train.prompts.load_prompts`, or
    ``prompt_ids`` as given (token ids already rendered, e.g. by ``dflash-prep evaluate`` for its
    benchmark sets; ``prompts_file`` is then only recorded, and may be None).

    Refuses a drafter whose export records a different target (the run contract's
    ``target_fingerprint``). Keys: ``format``/``version``; ``target`` (path and
    :func:`~dflash_prep.train.target.target_identity`), ``drafter`` (path and fingerprint),
    ``prompts`` (path, count);
    ``block_size``, ``temperature`` (0), ``max_new_tokens``; ``tau``, ``tau_pooled``, ``blocks``,
    ``histogram`` (counts of acceptance lengths 1..B); ``lossless`` (every prompt equal to the
    target's greedy output; null when not checked); ``new_tokens``; ``seconds_spec`` /
    ``seconds_greedy``; ``per_prompt``: ``prompt_tokens``, ``new_tokens``,
    ``acceptance_lengths``, ``tau``, ``lossless``, ``first_mismatch`` (index or null).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_prep.train.objectives.dflash.export import folder_fingerprint

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    target = Target(model)
    proposers, meta = drafter_of(drafter_dir, target, block_size=cfg.block_size)
    B = meta["block_size"]
    if B < 1:
        raise ConfigError(f"block size must be >= 1, got {B}")
    if int(model.config.hidden_size) != meta["hidden_size"] or int(model.config.vocab_size) != meta["vocab_size"]:
        raise ConfigError(f"{drafter_dir}: the drafter was built for hidden {meta['hidden_size']} / vocab "
                          f"{meta['vocab_size']}, the target {target_dir} has {model.config.hidden_size} / "
                          f"{model.config.vocab_size}; pass the target it was trained on")
    ident = target_identity(target_dir, tok)
    trained_on = (((meta.get("export") or {}).get("source") or {}).get("run_key") or {}).get("contract", {})
    want = trained_on.get("target_fingerprint")
    if want and want != ident["target_fingerprint"]:
        raise ConfigError(f"{drafter_dir} was trained on target {want}, but {target_dir} is "
                          f"{ident['target_fingerprint']}: a drafter reads its own target's hidden states; "
                          "pass the target folder the drafter was trained on")
    target.set_layers(meta["target_layer_ids"])
    stop = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    if prompt_ids is not None:
        prompts = [list(p) for p in (prompt_ids[:cfg.max_prompts] if cfg.max_prompts else prompt_ids)]
        if not prompts or not all(prompts):
            raise ConfigError("no prompts, or an empty one, to evaluate")
    else:
        prompts = load_prompts(prompts_file, tok, limit=cfg.max_prompts)
    greedy: list[Decoded | None] = [None] * len(prompts)
    results = {}
    for name, proposer in proposers:
        rows, t_spec, t_greedy = [], 0.0, 0.0
        for i, p in enumerate(prompts):
            d = speculative_generate(target, proposer, p, max_new_tokens=cfg.max_new_tokens, stop_ids=stop,
                                     engine_stop=cfg.engine_stop,
                                     mask_token_id=meta["mask_token_id"] or 0)
            t_spec += d.seconds
            row = {"prompt_tokens": len(p), "new_tokens": len(d.tokens), "acceptance_lengths": d.acceptance_lengths,
                   "tau": sum(d.acceptance_lengths) / max(len(d.acceptance_lengths), 1),
                   "lossless": None, "first_mismatch": None}
            if cfg.check_lossless:
                if greedy[i] is None:   # the target's own decode does not depend on the proposer
                    greedy[i] = greedy_generate(target, p, max_new_tokens=cfg.max_new_tokens, stop_ids=stop)
                    t_greedy += greedy[i].seconds
                g = greedy[i]
                row["lossless"] = g.tokens == d.tokens
                if not row["lossless"]:
                    row["first_mismatch"] = next((i for i, (x, y) in enumerate(zip(g.tokens, d.tokens)) if x != y),
                                                 min(len(g.tokens), len(d.tokens)))
            rows.append(row)
        results[name] = {**summarize(rows, B),
                         "lossless": all(r["lossless"] for r in rows) if cfg.check_lossless else None,
                         "new_tokens": sum(r["new_tokens"] for r in rows),
                         "seconds_spec": round(t_spec, 3), "seconds_greedy": round(t_greedy, 3), "per_prompt": rows}
    main_name = proposers[0][0]
    head = results[main_name]
    per_prompt = head.pop("per_prompt")
    variants = {name: {k: v for k, v in r.items() if k != "per_prompt"} for name, r in results.items()
                if name != main_name}
    return {"format": EVAL_FORMAT, "version": EVAL_VERSION,
            "target": {"path": str(target_dir), **ident},
            "drafter": {"path": str(drafter_dir), "fingerprint": folder_fingerprint(drafter_dir),
                        "architecture": meta["architecture"], "proposer": main_name},
            "prompts": {"path": None if prompts_file is None else str(prompts_file), "n": len(prompts)},
            "block_size": B, "temperature": 0.0, "max_new_tokens": cfg.max_new_tokens,
            **head, "variants": variants, "config": asdict(cfg), "per_prompt": per_prompt}


def drafter_of(drafter_dir: str | Path, target: Target, *, block_size: int = 0) -> tuple[list, dict]:
    """The proposers of the export at ``drafter_dir`` (``[(name, proposer), ...]``, the first one
    the main result, the others reported as ``variants``) and its meta: the objective whose export
    writes the folder's ``config.json`` ``architectures`` loads it
    (:attr:`~dflash_prep.train.objectives.registry.TrainerSpec.decode`)."""
    from dflash_prep.train.objectives import registry

    cfile = Path(drafter_dir) / "config.json"
    if not cfile.is_file():
        raise FormatError(f"{cfile}: not found; point --drafter at an exported drafter folder "
                          "(python -m dflash_prep.train.export RUN --out DIR)")
    try:
        archs = json.loads(cfile.read_text()).get("architectures") or []
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise FormatError(f"{cfile}: not a JSON object ({e})") from None
    for spec in registry.specs():
        hit = next((a for a in archs if a in spec.architectures), None)
        if hit is not None and spec.decode is not None:
            proposers, meta = spec.decode(drafter_dir, target, block_size=block_size)
            return proposers, {**meta, "architecture": hit}
    known = sorted(a for s in registry.specs() for a in s.architectures)
    raise FormatError(f"{cfile}: architectures {archs} is none this tool decodes ({', '.join(known)})")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m dflash_prep.train.speculate",
                                 description="Mean acceptance length of an exported DFlash drafter (temperature 0), "
                                             "checked lossless against the target's greedy output.")
    ap.add_argument("--target", required=True, type=Path, help="transformers causal-LM folder (with tokenizer)")
    ap.add_argument("--drafter", required=True, type=Path, help="exported drafter folder (export.py)")
    ap.add_argument("--prompts", required=True, type=Path, help="JSONL of {messages} or {prompt}")
    ap.add_argument("--out", required=True, type=Path, help="result JSON to write")
    ap.add_argument("--max-new-tokens", type=int, default=EvalConfig.max_new_tokens)
    ap.add_argument("--max-prompts", type=int, default=EvalConfig.max_prompts)
    ap.add_argument("--block-size", type=int, default=EvalConfig.block_size, help="0 = the drafter's")
    ap.add_argument("--no-lossless-check", action="store_true", help="skip the target-only greedy decode")
    a = ap.parse_args(argv)
    try:
        cfg = EvalConfig(max_new_tokens=a.max_new_tokens, max_prompts=a.max_prompts, block_size=a.block_size,
                         check_lossless=not a.no_lossless_check)
        with torch.no_grad():           # scoped: a caller in the same process keeps its grad mode
            res = evaluate(a.target, a.drafter, a.prompts, cfg)
    except DflashError as e:
        raise SystemExit(f"error: {e}") from None
    atomic_write_json(a.out, res, format=EVAL_FORMAT, version=EVAL_VERSION)
    lossless = {True: "lossless", False: "NOT lossless", None: "lossless not checked"}[res["lossless"]]
    print(f"tau {res['tau']:.3f} (pooled {res['tau_pooled']:.3f}) at B = {res['block_size']} over "
          f"{res['prompts']['n']} prompts, {res['blocks']} blocks, {lossless}; {a.out}")
    return res


if __name__ == "__main__":
    main()

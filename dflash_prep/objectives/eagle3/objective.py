"""``pack --objective eagle3``: varlen micro-batches for EAGLE-3 drafter training, with its vocabulary map.

Packing is the varlen layout's (:func:`dflash_prep.pack.bucketing.pack_varlen` under the token
budget T, every varlen option: ``--open-bins``, ``max_batch_size``, the schedules, ``--drop-last``,
resume): an eagle3 epoch holds the micro-batches an lm varlen epoch of the same plan holds.
Ranks are balanced (LPT, :func:`dflash_prep.pack.steps.assign_ranks`) on the EAGLE-3 step
FLOPs, ``a sum L + b sum L^2`` per micro-batch
(:class:`~dflash_prep.objectives.drafter_cost.Eagle3CostModel`): the ``ttt_steps`` drafter
passes are a large share of a step and the attention term is quadratic, so tokens alone
mis-price it. Its quadratic share is small at typical lengths, so no cost budget is needed:
token-balanced micro-batches are nearly cost-balanced, and LPT does the rest.

Every epoch folder adds ``d2t.npy`` (int64) and ``t2d.npy`` (bool), the draft vocabulary of
:mod:`.vocab_map` from the dataset's token counts (:mod:`dflash_prep.formats.token_counts`: counted once, kept in
``DATA/token_counts.npy``), and the header an ``eagle3`` section: ``draft_vocab_size``,
``ttt_steps``, ``vocab_size``, ``tie_rule``, ``counted``, ``counts_fingerprint``,
``map_fingerprint``, ``map_version``, ``trained_ids``, ``vocab_coverage`` and the
``cost_model``. ``verify`` recounts the tokens from the shards, checks
``DATA/token_counts.npy`` and the recorded fingerprints against the recount, rebuilds the
map and compares it with the epoch's arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_prep.errors import ConfigError
from dflash_prep.formats.dataset import open_dataset
from dflash_prep.formats.fileio import fingerprint_array
from dflash_prep.objectives import options as opt_decl
from dflash_prep.objectives.base import DataObjective
from dflash_prep.objectives.dflash import PREDICT_WORLD_SIZE
from dflash_prep.objectives.drafter_cost import Eagle3CostModel
from dflash_prep.formats import token_counts as counts_mod
from dflash_prep.objectives.eagle3 import vocab_map
from dflash_prep.objectives.eagle3.options import Eagle3Options
from dflash_prep.objectives.serving import Serving
from dflash_prep.objectives.target_taps import StatesNeed, eagle3_taps, states_estimate
from dflash_prep.pack import bucketing, metrics, steps


@dataclass(frozen=True)
class Eagle3Inputs:
    """What every epoch of a pack call shares: the dataset's token counts and their map."""

    counts: counts_mod.TokenCounts
    vmap: vocab_map.VocabMap


def _batch_sums(lens: np.ndarray, order: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and sum of squared lengths per micro-batch (int64), ``order`` cut by ``offsets``."""
    lo = np.asarray(lens, np.int64)[order]
    if not len(lo):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.add.reduceat(lo, offsets[:-1]), np.add.reduceat(lo * lo, offsets[:-1])


def section(opts: Eagle3Options, inputs: Eagle3Inputs) -> dict:
    """The manifest header's ``eagle3`` section (module docstring)."""
    vm = inputs.vmap
    return {**opt_decl.header(opts), "vocab_size": vm.vocab_size, "tie_rule": vocab_map.TIE_RULE,
            "counted": counts_mod.COUNTED, "counts_fingerprint": inputs.counts.fingerprint,
            "map_fingerprint": vm.fingerprint, "map_version": vocab_map.MAP_VERSION, "trained_ids": vm.trained_ids,
            "vocab_coverage": vm.coverage, "cost_model": opts.step_cost_model().describe()}


def export_problems(c: dict, L: int, shapes) -> list[str]:
    """:attr:`~dflash_prep.objectives.serving.Serving.problems` of an EAGLE-3 export: its taps
    (vLLM's ids, the inputs of layers 1..L-1) and its vocabulary map's rows (``d2t``, the head)
    against ``draft_vocab_size``."""
    out = []
    ids = c.get("eagle_aux_hidden_state_layer_ids") or []
    bad = [j for j in ids if not 1 <= int(j) <= L - 1]
    if bad:
        out.append(f"eagle_aux_hidden_state_layer_ids {ids} (vLLM: inputs of layers 1..{L - 1}) reach outside the "
                   f"target's {L} layers")
    rows = shapes()
    vd = c.get("draft_vocab_size")
    for name in ("d2t", "lm_head.weight"):
        if name in rows and vd is not None and rows[name][:1] != [int(vd)]:
            out.append(f"config.json draft_vocab_size {vd} but {name} has {rows[name][0]} rows")
    return out


class Eagle3Objective(DataObjective):
    """``pack --objective eagle3`` (module docstring)."""

    name = "eagle3"
    layouts = ("varlen",)
    options_type = Eagle3Options
    summary_keys = ("token_fill", "microbatches", "rank_imbalance", "world_size", "drafter_cost_share")
    rank_cost_name = "eagle3"
    reads_states = True
    fixed_states = "EAGLE-3 always reads its three taps and the final hidden state"
    serving = Serving("LlamaForCausalLMEagle3", "EAGLE-3", export_problems, chain_k=7)

    def states_need(self, num_target_layers, *, draft_layers=None, target_layer_ids=(), loss="ce"):
        return StatesNeed(eagle3_taps(num_target_layers, tuple(int(i) for i in target_layer_ids)), True)

    def states_estimate(self, options, tokens: int) -> str | None:
        cm = getattr(options, "cost_model", None)
        if cm is None:
            return None
        return states_estimate(self.name, cm.layers, cm.hidden, tokens)

    def check(self, layout, options) -> None:
        if layout == "padded":
            raise ConfigError("--objective eagle3 packs the varlen layout only (padding wastes target tokens and "
                              "every drafter pass); drop --layout padded")
        if not isinstance(options, Eagle3Options):
            raise ConfigError(f"--objective eagle3 needs its options (Eagle3Options), got {type(options).__name__}")

    def resolve(self, options, *, plan, budget):
        if budget.unit != "tokens":
            raise ConfigError("--objective eagle3 takes a token budget T (target forward memory); ranks are balanced "
                              "on its step cost: pass --budget-unit tokens")
        return options.resolve()

    def inputs(self, cfg, src):
        if src.kind != "dataset":
            raise ConfigError(f"{src.path}: --objective eagle3 needs a tokenized dataset folder (the token counts of "
                              "its vocabulary map), not a lengths file")
        tc = counts_mod.token_counts(src.path)
        return Eagle3Inputs(tc, vocab_map.build(tc.counts, cfg.options.draft_vocab_size)), None

    def begin_epoch(self, lens, cfg, epoch, inputs):
        if not isinstance(inputs, Eagle3Inputs):
            raise ConfigError("--objective eagle3 needs the token counts of a tokenized dataset; pack a dataset "
                              "folder, not a lengths file")
        return inputs

    def rank_cost(self, cfg, state, order, offsets, se):
        return cfg.options.step_cost_model().batch_cost(se.real, se.sq), se.real     # FLOPs per micro-batch

    def finish_epoch(self, state, cfg, epoch, arrays, header, summary, rows, dataset) -> None:
        arrays["d2t"], arrays["t2d"] = state.vmap.d2t, state.vmap.t2d
        header[self.name] = section(cfg.options, state)
        summary.update(draft_vocab_size=state.vmap.draft_vocab_size, trained_ids=state.vmap.trained_ids,
                       vocab_coverage=state.vmap.coverage)

    def predicts_plan(self, cfg) -> bool:
        return False

    def required_arrays(self, header: dict) -> list[str]:
        return ["d2t", "t2d"]

    def verify(self, m, lens, ids, offsets, src):
        """Recount, rebuild and compare (module docstring); ``(problems, summary entries, None)``."""
        if src.kind != "dataset":
            return [f"{src.path}: an eagle3 manifest is verified against its dataset folder (the token counts); "
                    "pass --data"], {}, None
        d = m.header.get(self.name) or {}
        try:
            dv = int(d["draft_vocab_size"])
            recorded = {k: d[k] for k in ("counts_fingerprint", "map_fingerprint", "trained_ids", "vocab_size")}
        except (KeyError, TypeError, ValueError):
            return [f"{m.path / 'manifest.json'}: the eagle3 section lacks the map's fields; re-pack the epoch"], {}, \
                None
        ds = open_dataset(src.path)
        counted = counts_mod.recount(ds)
        problems = counts_mod.file_problems(src.path, counted, ds.fingerprint)
        if recorded["counts_fingerprint"] != fingerprint_array(counted):
            problems.append(f"{m.path / 'manifest.json'}: records token counts {recorded['counts_fingerprint']}, the "
                            f"shards count {fingerprint_array(counted)}; re-pack the epoch")
        try:
            vm = vocab_map.build(counted, dv)
        except ConfigError as e:
            return problems + [f"{m.path / 'manifest.json'}: {e}"], {}, None
        for name, want in (("d2t", vm.d2t), ("t2d", vm.t2d)):
            got = np.asarray(m.arrays[name])
            if got.shape != want.shape or not np.array_equal(got, want):
                n = int((got != want).sum()) if got.shape == want.shape else max(got.size, want.size)
                problems.append(f"{m.path / (name + '.npy')}: differs in {n} entries from the map the dataset's token "
                                "counts give; re-pack the epoch")
        for key, want in (("map_fingerprint", vm.fingerprint), ("trained_ids", vm.trained_ids),
                          ("vocab_size", vm.vocab_size)):
            if recorded[key] != want:
                problems.append(f"{m.path / 'manifest.json'}: eagle3 {key} {recorded[key]!r}, rebuilt {want!r}; "
                                "re-pack the epoch")
        return problems, {"draft_vocab_size": dv, "trained_ids": vm.trained_ids, "vocab_coverage": vm.coverage}, None

    def verify_rank_cost(self, m, lens, order, offsets, state) -> np.ndarray:
        return Eagle3CostModel.of_record(m.header[self.name]["cost_model"]).batch_cost(*_batch_sums(lens, order,
                                                                                                   offsets))

    def predict(self, src, options, budget, *, seed: int) -> dict:
        """What ``pack --objective eagle3`` will give, from epoch 0 of the real packer (lengths
        only): token fill, micro-batches, the rank imbalance of LPT on the step cost over
        :data:`PREDICT_WORLD_SIZE` ranks (one micro-batch each) and the drafter's cost share."""
        cm = self.resolve(options, plan=None, budget=budget).step_cost_model()
        lens = np.asarray(src.lengths)
        order, offsets, _ = bucketing.pack_varlen(lens, seed=seed, epoch=0, budget=budget)
        real, sq = _batch_sums(lens, order, offsets)
        cost = cm.batch_cost(real, sq)
        w = PREDICT_WORLD_SIZE
        m, imb = len(cost) - len(cost) % w, None
        if m:
            perm, step, rank, _ = steps.assign_ranks(cost[:m], w, 1)
            imb = metrics.rank_imbalance(cost[:m][perm], step, rank, w)
        t = cm.terms()
        target = float((t["target"] + t["target_head"]) * real.sum() + t["target_sq"] * sq.sum())
        return {"token_fill": float(real.mean()) / float(budget.value) if len(real) else 0.0,
                "microbatches": int(len(cost)), "rank_imbalance": imb, "world_size": w,
                "drafter_cost_share": 1.0 - target / float(cost.sum()) if len(cost) else 0.0}

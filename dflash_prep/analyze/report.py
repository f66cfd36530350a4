"""How ``analyze`` shows its result: rich tables, a versioned JSON report, and a PNG.

The report dict is built by :func:`dflash_prep.analyze.analyze.run`; this module only renders it.
``analyze-report.json`` (format ``dflash-prep/analyze-report`` v1) is the same dict that
``--json`` prints. The PNG (matplotlib, Agg backend, no display needed) has two panels:
the length histogram on a log length axis with the chosen boundaries, and the trade-off of
efficiency against repeat-pair rate over the window and K tables, the plan's point marked.
"""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dflash_prep.errors import ConfigError
from dflash_prep.formats.fileio import atomic_write_bytes, atomic_write_json, canonical_json, holds_marker

REPORT_FORMAT = "dflash-prep/analyze-report"
REPORT_VERSION = 1
REPORT_FILE = "analyze-report.json"
PNG_FILE = "analyze.png"
PNG_SOFTWARE = "dflash-prep analyze"  # the PNG's tEXt "Software" entry: the file's ownership marker


def check_outputs(out: Path, *, plot: bool) -> None:
    """Refuse, before any work, to overwrite a report or PNG under ``out`` that is not ours."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; it was left untouched. Choose another --out")
    rp = out / REPORT_FILE
    if rp.exists() and not holds_marker(out, REPORT_FILE, REPORT_FORMAT):
        raise ConfigError(f"{rp} exists and is not a dflash-prep report; it was left untouched. Choose another --out")
    png = out / PNG_FILE
    if plot and png.exists():
        with open(png, "rb") as f:
            head = f.read(1 << 16) if png.is_file() else b""
        if not head.startswith(b"\x89PNG") or PNG_SOFTWARE.encode() not in head:
            raise ConfigError(f"{png} exists and was not written by dflash-prep; it was left untouched. Choose "
                              "another --out or pass --no-plot")


def write_json(rep: dict, out: Path) -> Path:
    path = Path(out) / REPORT_FILE
    atomic_write_json(path, rep, format=REPORT_FORMAT, version=REPORT_VERSION)
    return path


def to_json(rep: dict) -> str:
    """The report as one JSON document (what ``--json`` prints)."""
    return canonical_json({"format": REPORT_FORMAT, "version": REPORT_VERSION, **rep})


def plot(hist, rep: dict, out: Path) -> Path:
    """Two panels, written atomically (path returned):

    - the length histogram on a log length axis (samples per distinct length, log scale),
      with the plan's boundaries;
    - the trade-off: efficiency against repeat-pair rate for the window table (at the plan's
      K), the K x window candidates and the K table (window 0), the limit as a vertical
      line and the plan's point marked.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    ax1.plot(hist.values, hist.counts, drawstyle="steps-mid", color="#4c72b0", lw=0.8)
    for b in rep["boundaries"]:
        ax1.axvline(b, color="#c44e52", lw=1)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("length (tokens, log scale)")
    ax1.set_ylabel("samples per length")
    ax1.set_title(f"{rep['stats']['count']:,} samples; K={rep['k']} boundaries")
    floor = 1e-6  # repeat-pair 0 on a log axis

    def pts(rows):
        return [max(r["repeat_pair"], floor) for r in rows], [r["efficiency"] for r in rows]

    x, y = pts(rep["pareto_window"])
    ax2.plot(x, y, "o-", ms=4, label=f"windows at K={rep['k']} (simulated)")
    rows = rep["pareto_window"]
    every = max(1, -(-len(rows) // 9))        # at most ~9 labels, so large tables stay legible
    for i, r in enumerate(rows):
        if i % every == 0 or i == len(rows) - 1:
            ax2.annotate(f"{r['window']:,}", (max(r["repeat_pair"], floor), r["efficiency"]), fontsize=7,
                         textcoords="offset points", xytext=(3, -9))
    x, y = pts(rep["joint"])
    ax2.plot(x, y, "s", ms=5, mfc="none", label="per-K pick (simulated)")
    x, y = pts(rep["pareto_k"])
    ax2.plot(x, y, ".--", ms=4, alpha=0.7, label="K = 1..32, window 0 (model)")
    ax2.axvline(rep["max_repeat_pair"], color="#888888", lw=1, ls=":", label=f"limit {rep['max_repeat_pair']:g}")
    p = rep["predicted"]
    ax2.plot([max(p["repeat_pair"], floor)], [p["efficiency"]], "*", ms=16, color="#c44e52",
             label=f"plan: K={rep['k']}, window {rep['window']}")
    ax2.set_xscale("log")
    ax2.set_xlabel("repeat-pair rate (log scale)")
    ax2.set_ylabel("padding efficiency")
    ax2.set_title(f"budget {rep['budget']['value']:.0f} {rep['budget']['unit']}")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": PNG_SOFTWARE})
    plt.close(fig)
    path = Path(out) / PNG_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


def _table(title: str, cols: list[str]):
    """A rich table whose cells wrap (fold) instead of being cut: it fits 80 columns."""
    t = Table(title=title, title_justify="left", pad_edge=False, padding=(0, 1))
    for c in cols:
        t.add_column(c, justify="left" if c in ("strategy", "boundaries") else "right", overflow="fold")
    return t


def render(rep: dict, console=None) -> None:
    """Print the stats, strategy, K x window, window and K tables and the output paths.

    Every table has at most 7 short columns and folds long cells (boundaries), so it reads
    in an 80-column terminal; how each figure was obtained is said once under each table.
    """
    con = console or Console()
    s = rep["stats"]
    t = _table(f"lengths: {rep['data']['path']}", ["count", "tokens", "p1", "p50", "p99", "max", "at max"])
    pile = s["pile_at_max"]
    t.add_row(f"{s['count']:,}", f"{s['total_tokens']:,}", *(str(s[k]) for k in ("p1", "p50", "p99", "max")),
              f"{100 * pile['share']:.2f}%")
    con.print(t)

    b = rep["budget"]
    t = _table(f"strategies at budget {b['value']:.0f} {b['unit']}",
               ["strategy", "eff pred", "eff sim", "fill", "repeat", "spread"])
    for r in rep["strategies"]:
        t.add_row(r["name"], f"{r['efficiency_pred']:.4f}", f"{r['efficiency_sim']:.4f}", f"{r['fill']:.4f}",
                  f"{r['repeat_pair']:.4f}", f"{r['spread']:.3f}")
    con.print(t)
    sim = rep["simulated_samples"]
    con.print(f"pred: renewal-chain model; sim: pack's packer over {sim:,} samples"
              + ("" if sim >= s["count"] else " (a subsample; repeat-pair rescaled to the full buckets)")
              + "; repeat = repeat-pair rate")

    t = _table(f"K x window: per K, the rule's pick (repeat-pair <= {rep['max_repeat_pair']:g}, "
               "then within 0.5 pp of the best, least repeat-pair)",
               ["K", "window", "efficiency", "repeat", "spread", "micro-batches"])
    for r in rep["joint"]:
        mark = " *" if (r["k"], r["window"]) == (rep["k"], rep["window"]) else ""
        t.add_row(f"{r['k']}{mark}", str(r["window"]), f"{r['efficiency']:.4f}", f"{r['repeat_pair']:.4f}",
                  f"{r['spread']:.3f}", f"{r['microbatches']:,.0f}")
    con.print(t)

    t = _table(f"windows at K={rep['k']} (simulated; up to the first past the limit)",
               ["window", "efficiency", "fill", "repeat", "spread", "micro-batches"])
    for r in rep["pareto_window"]:
        t.add_row(f"{r['window']:,}", f"{r['efficiency']:.4f}", f"{r['fill']:.4f}", f"{r['repeat_pair']:.4f}",
                  f"{r['spread']:.3f}", f"{r['microbatches']:,.0f}")
    con.print(t)

    t = _table("K table, window 0 (efficiency: chain model; repeat, spread: analytic)",
               ["K", "efficiency", "equal-mass", "repeat", "boundaries"])
    for r in rep["pareto_k"]:
        t.add_row(str(r["k"]), f"{r['efficiency']:.4f}", f"{r['equal_mass_efficiency']:.4f}",
                  f"{r['repeat_pair']:.5f}", " ".join(map(str, r["boundaries"])))
    con.print(t)

    p = rep["predicted"]
    how = {"joint": "K and window chosen together", "given": "given"}
    line = (f"plan: K={rep['k']} ({how.get(rep.get('k_how'), rep.get('k_how'))}), window {p['window']} "
            f"({'given' if rep.get('window_how') == 'given' else 'chosen'}), boundaries {rep['boundaries']}: "
            f"efficiency {p['efficiency']:.4f}, repeat-pair {p['repeat_pair']:.4f} (limit {rep['max_repeat_pair']:g})")
    mix = p.get("step_mix")
    if mix:
        line += f", step mix {mix['step_mix']:.3f} at W={mix['world_size']} x A={mix['grad_accum']}"
    if p["window"]:
        line += f"; window 0: {p['window0']['efficiency']:.4f} (model)"
    con.print(line)
    for w in rep.get("warnings", ()):
        con.print(f"[yellow]warning:[/yellow] {w}")
    con.print(f"plan: {rep['plan']}")
    con.print(f"report: {rep['report']}")
    if rep.get("png"):
        con.print(f"plot: {rep['png']}")

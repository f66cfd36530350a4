"""How ``analyze`` shows its result: rich tables, a versioned JSON report, and a PNG.

The report dict is built by :func:`dflash_prep.analyze.run`; this module only renders it.
``analyze-report.json`` (format ``dflash-prep/analyze-report`` v1) is the same dict that
``--json`` prints. The PNG (matplotlib, Agg backend, no display needed) has two panels:
the length histogram with the chosen boundaries, and predicted efficiency per K for the
optimal and the equal-mass boundaries.
"""

from __future__ import annotations

from pathlib import Path

from .fileio import atomic_write_bytes, atomic_write_json, canonical_json

REPORT_FORMAT = "dflash-prep/analyze-report"
REPORT_VERSION = 1
REPORT_FILE = "analyze-report.json"
PNG_FILE = "analyze.png"
PNG_SOFTWARE = "dflash-prep analyze"  # the PNG's tEXt "Software" entry: the file's ownership marker


def check_outputs(out: Path, *, plot: bool) -> None:
    """Refuse, before any work, to overwrite a report or PNG under ``out`` that is not ours."""
    from .errors import ConfigError
    from .fileio import holds_marker

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
    """Histogram with boundaries + efficiency per K; written atomically, path returned."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    import numpy as np

    # one step per length (zeros included): a single path; bars would draw thousands of patches
    lo, hi = int(hist.values[0]), int(hist.values[-1])
    dense = np.zeros(hi - lo + 1)
    dense[hist.values - lo] = hist.counts
    ax1.stairs(dense, np.arange(lo, hi + 2, dtype=np.float64), fill=True, color="#4c72b0", baseline=0.5)
    for b in rep["boundaries"]:
        ax1.axvline(b, color="#c44e52", lw=1)
    ax1.set_yscale("log")
    ax1.set_xlabel("length (tokens)")
    ax1.set_ylabel("samples")
    ax1.set_title(f"{rep['stats']['count']:,} samples; K={rep['k']} optimal boundaries")
    ks = [r["k"] for r in rep["pareto_k"]]
    ax2.plot(ks, [r["efficiency"] for r in rep["pareto_k"]], "o-", ms=3, label="optimal (model)")
    ax2.plot(ks, [r["equal_mass_efficiency"] for r in rep["pareto_k"]], "s--", ms=3, label="equal-mass (model)")
    ax2.axvline(rep["k"], color="#c44e52", lw=1)
    ax2.set_xlabel("buckets K")
    ax2.set_ylabel("padding efficiency (window 0)")
    ax2.set_title(f"budget {rep['budget']['value']:.0f} {rep['budget']['unit']}")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": PNG_SOFTWARE})
    plt.close(fig)
    path = Path(out) / PNG_FILE
    atomic_write_bytes(path, buf.getvalue())
    return path


def render(rep: dict, console=None) -> None:
    """Print the stats, strategy and Pareto tables and the output paths."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    s = rep["stats"]
    t = Table(title=f"lengths: {rep['data']['path']}")
    for c in ("count", "total tokens", "min", "p1", "p50", "p90", "p99", "max", f"pile at {s['max']}"):
        t.add_column(c, justify="right")
    pile = s["pile_at_max"]
    qs = (str(s[k]) for k in ("min", "p1", "p50", "p90", "p99", "max"))
    t.add_row(f"{s['count']:,}", f"{s['total_tokens']:,}", *qs,
              f"{pile['count']:,} ({100 * pile['share']:.2f}%)")
    con.print(t)

    b = rep["budget"]
    t = Table(title=f"strategies at budget {b['value']:.0f} {b['unit']} "
                    "(pred = renewal-chain model; sim = mean of simulated epochs)")
    for c in ("strategy", "eff pred", "eff sim", "fill", "micro-batches", "repeat-pair", "spread", "how"):
        t.add_column(c, justify="left" if c in ("strategy", "how") else "right")
    for r in rep["strategies"]:
        t.add_row(r["name"], f"{r['efficiency_pred']:.4f}", f"{r['efficiency_sim']:.4f}", f"{r['fill']:.4f}",
                  f"{r['microbatches']:,.0f}", f"{r['repeat_pair']:.5f}", f"{r['spread']:.3f}", r["how"])
    con.print(t)

    t = Table(title="Pareto over K (window 0): efficiency = renewal-chain model; "
                    "repeat-pair, spread = analytic estimates")
    for c in ("K", "efficiency", "equal-mass", "micro-batches", "repeat-pair", "spread"):
        t.add_column(c, justify="right")
    t.add_column("boundaries", no_wrap=True, overflow="ellipsis", max_width=48)
    for r in rep["pareto_k"]:
        t.add_row(str(r["k"]), f"{r['efficiency']:.4f}", f"{r['equal_mass_efficiency']:.4f}",
                  f"{r['microbatches']:,.0f}", f"{r['repeat_pair']:.5f}", f"{r['spread']:.3f}",
                  ", ".join(map(str, r["boundaries"])))
    con.print(t)

    t = Table(title=f"Pareto over the local sort window, K={rep['k']} optimal (simulated)")
    for c in ("window", "efficiency", "fill", "micro-batches", "repeat-pair", "spread"):
        t.add_column(c, justify="right")
    for r in rep["pareto_window"]:
        t.add_row(str(r["window"]), f"{r['efficiency']:.4f}", f"{r['fill']:.4f}", f"{r['microbatches']:,.0f}",
                  f"{r['repeat_pair']:.5f}", f"{r['spread']:.3f}")
    con.print(t)

    p = rep["predicted"]
    how = " (auto: largest window within +0.01 repeat-pair of window 0)" if rep.get("window_how") == "auto" else ""
    line = (f"K={rep['k']} boundaries {rep['boundaries']}; window {p['window']}{how}: predicted efficiency "
            f"{p['efficiency']:.4f} ({p['how']})")
    if p["window"]:
        line += f"; window 0: {p['window0']['efficiency']:.4f} (model)"
    con.print(line)
    for w in rep.get("warnings", ()):
        con.print(f"[yellow]warning:[/yellow] {w}")
    con.print(f"plan: {rep['plan']}")
    con.print(f"report: {rep['report']}")
    if rep.get("png"):
        con.print(f"plot: {rep['png']}")

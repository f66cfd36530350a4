"""The picture of an engine evaluation report (v2): ``<out stem>.png`` beside the JSON.

Left: tau from vLLM's counters per prompt set, one bar per drafter (the table's rows: the exports,
then the ``--baseline`` speculators, their bars edged with dots), lossless failures hatched. Right: the share of drafts accepted at each position, one line per drafter and
set (colour: set, line style: drafter), the curve whose area is tau - 1.
"""

from __future__ import annotations

import io
from pathlib import Path

from dflash_prep.engine.report_table import table_rows
from dflash_prep.formats.fileio import atomic_write_bytes

PNG_SOFTWARE = "dflash-prep evaluate"
STYLES = ("-", "--", ":", "-.")


def write_plot(res: dict, path: Path) -> Path:
    """Draw ``res`` (module docstring) to ``path``, atomically (matplotlib, Agg: no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s["name"] for s in res["sets"]]
    exports = table_rows(res)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(exports), 1)
    for j, e in enumerate(exports):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(sets))]
        taus = [e["sets"][s]["vllm"]["tau"] or 0.0 for s in sets]
        lossy = [e["sets"][s]["lossless"]["checked"] and not e["sets"][s]["lossless"]["ok"] for s in sets]
        baseline = e["kind"] == "baseline"
        what = "baseline" if baseline else f"{e['kind']}, k = {e['num_speculative_tokens']}"
        bars = ax1.bar(xs, taus, width * 0.95, label=f"{e['label']} ({what})", color=colors[j % len(colors)],
                       edgecolor="black" if baseline else None, linestyle=":" if baseline else "-")
        for b, tau, bad in zip(bars, taus, lossy):
            if bad:
                b.set_hatch("xx")
            ax1.annotate(f"{tau:.2f}", (b.get_x() + b.get_width() / 2, tau), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(sets)), sets)
    ax1.set_ylabel("tau (vLLM counters)")
    ax1.axhline(1.0, color="#888888", lw=0.8, ls=":")
    mode = {None: "template default", True: "on", False: "off"}[res["thinking"]["enable_thinking"]]
    ax1.set_title(f"tau per set: vLLM {res['engine']['version']}, T = {res['sampling']['temperature']:g}, "
                  f"thinking {mode}", fontsize=10)
    top = max([e["sets"][s]["vllm"]["tau"] or 0.0 for e in exports for s in sets] + [1.0])
    ax1.set_ylim(0, top * 1.25)                      # room for the legend above the bars
    ax1.legend(fontsize=8, loc="upper left", ncol=min(len(exports), 2))
    for j, e in enumerate(exports):
        for i, s in enumerate(sets):
            acc = e["sets"][s]["vllm"]["acceptance_per_position"]
            if acc:
                ax2.plot(range(1, len(acc) + 1), acc, STYLES[j % len(STYLES)], marker="o", ms=3,
                         color=colors[i % len(colors)], label=f"{s}, {e['label']}")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("share of drafts accepted")
    ax2.set_ylim(0, 1.02)
    ax2.set_title("acceptance per position", fontsize=10)
    ax2.grid(alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=7, loc="lower left", ncol=max(1, len(exports)))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": PNG_SOFTWARE})
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path

"""An engine evaluation report (format ``dflash-prep/engine-eval``) as the rows of a two-column
table: what ``dflash-prep evaluate`` prints. A pure function of one report dict: it reads no file,
so any number of reports (one per export or prompt set) render the same way.
"""

from __future__ import annotations

from dflash_prep.engine import contamination
from dflash_prep.engine.ours import AGREE_REL
from dflash_prep import objectives


BASELINE_NOTE = ("baselines: speculators without a drafter, on the same prompts and base run; vLLM counts a draft only "
                 "where one was proposed, so an n-gram's tau is over the steps that found a match")


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _verdict(agree: bool, rel_diff: float | None) -> str:
    if rel_diff is None:                # a tau missing on one side: nothing was drafted
        return "not compared (no tau: nothing drafted)"
    return (f"{'agree' if agree else 'DISAGREE'} (|diff| {rel_diff * 100:.2f} % of ours, "
            f"limit {AGREE_REL * 100:g} %)")


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
        rows.append(("vLLM vs ours", f"{_verdict(o['agree'], o['rel_diff'])}; same acceptance on "
                                     f"{o['prompts_same_acceptance']}/{o['of']} prompts"
                                     + "".join(f"; prompt {d['prompt']}: vLLM {d['vllm']}, ours {d['ours']} "
                                               "(drafts, accepted, new tokens)" for d in o["differing_prompts"][:3])))
    rows += [("tokens/s", f"spec {t['spec_tokens_per_s']:.1f}, base {t['base_tokens_per_s']:.1f}, speedup "
                          f"{_f(t['speedup'], '.2f')}" + (f" ({t['note']})" if t["note"] else "")),
             ("engine start", f"spec {res['engine']['spec']['start_s']:.1f} s, base {res['engine']['base']['start_s']:.1f} s"),
             ("wall", f"{res['seconds']:.1f} s (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                                       for k, v in (res.get("phases_s") or {}).items()) + ")")]
    return rows


def table_rows(res: dict) -> list[dict]:
    """The report's rows, in the table's order: the exports, then the baselines (``--baseline``;
    absent from reports written before them)."""
    return res["exports"] + res.get("baselines", [])


def _kind(name: str) -> str:
    """An export's kind as the table names it: its objective's ``Serving.label`` (the name when unknown)."""
    if name == "baseline":
        return "baseline"
    o = next((o for o in objectives.served().values() if o.name == name), None)
    return name if o is None else o.serving.label


def _cell_tau(c: dict) -> str:
    """A table cell: vLLM's tau, marked where the run was not lossless or ours disagrees."""
    tau = _f(c["vllm"]["tau"], ".2f")
    marks = ""
    if c["lossless"]["checked"] and not c["lossless"]["ok"]:
        marks += " (not lossless)"
    o = c["ours"] or {}
    if "skipped" not in o and o.get("rel_diff") is not None and not o.get("agree"):
        marks += " (ours differs)"
    return tau + marks


def _partial_lines(res: dict) -> list[str]:
    """A partial report's heading (a run that stopped: what it completed, what it did not run)."""
    p = res.get("partial")
    if not p:
        return []
    done = (["the base run"] if p["base_run"] else []) + p["exports_done"] + p["baselines_done"]
    missing = ([] if p["base_run"] else ["the base run"]) + p["exports_not_done"] + p["baselines_not_done"]
    return [f"# PARTIAL: the run stopped on {p['error']}", "",
            f"Completed: {', '.join(done) or 'nothing'}. Not run: {', '.join(missing) or 'nothing'}.", ""]


def first_answer_notes(res: dict) -> list[str]:
    """One line per multi-turn set whose second turns rest on first answers cut at their cap."""
    out = []
    for s in res["sets"]:
        f = s.get("first_answers") or {}
        if f.get("truncated"):
            out.append(f"{s['name']}: {f['truncated']} of {f['of']} second turns rest on a first answer cut at its "
                       f"{f['cap']}-token cap (finish_reason length)")
    return out


def markdown_table(res: dict) -> str:
    """A v2 report as markdown: tau per drafter (rows: the exports, then the baselines) and prompt set
    (columns) in the layout drafter cards use, then one detail row per drafter and set (the ``<out
    stem>.md`` beside the report); a partial report (a run that stopped) opens with what it holds."""
    rows = table_rows(res)
    sets = [s["name"] for s in res["sets"]]
    smp = res["sampling"]
    think = res["thinking"]
    mode = {None: "template default", True: "on", False: "off"}[think["enable_thinking"]]
    lines = _partial_lines(res)
    version = res["engine"]["version"] or "(never served)"
    lines += [f"# tau per benchmark: vLLM {version}, temperature {smp['temperature']:g}, "
              f"thinking {mode}, <= {smp['max_tokens']} new tokens", "",
              "tau = 1 + accepted / drafts, from vLLM's spec-decode counters over each set.", "",
              "| drafter | method | " + " | ".join(sets) + " | all |",
              "|---|---|" + "---:|" * (len(sets) + 1)]
    for e in rows:
        lines.append(f"| {e['label']} | {_kind(e['kind'])}, k = {e['num_speculative_tokens']} | "
                     + " | ".join(_cell_tau(e["sets"][s]) for s in sets) + f" | {_f(e['vllm']['tau'], '.2f')} |")
    lines += ["", "New tokens per target step (what decoding gains: equal to tau where every step drafts; below "
              "it where a speculator drafts only on a match).", "",
              "| drafter | " + " | ".join(sets) + " | all |", "|---|" + "---:|" * (len(sets) + 1)]
    for e in rows:
        lines.append(f"| {e['label']} | " + " | ".join(_f(e["sets"][s]["vllm"].get("tokens_per_step"), ".2f")
                                                      for s in sets)
                     + f" | {_f(e['vllm'].get('tokens_per_step'), '.2f')} |")
    counts = ", ".join(f"{s['name']} {s['prompts']} prompts" + (f" ({s['conversations']} conversations)"
                                                                if s["prompts"] != s["conversations"] else "")
                       for s in res["sets"])
    lines += ["", f"Prompts: {counts}; seed {smp['seed']}.", "",
              "| drafter | set | tau vLLM | tau ours | agree | lossless | accepted per position | tok/s spec / base |",
              "|---|---|---:|---:|---|---|---|---:|"]
    for e in rows:
        for s in sets:
            c = e["sets"][s]
            o, loss, t = c["ours"] or {}, c["lossless"], c["throughput"]
            ours = "-" if "skipped" in o else _f(o.get("tau_pooled"), ".3f")
            agree = "-" if "skipped" in o or o.get("rel_diff") is None else \
                f"{'yes' if o['agree'] else 'NO'} {o['rel_diff'] * 100:.2f}%"
            lossless = f"{loss['equal']}/{loss['of']}" if loss["checked"] else "not claimed"
            acc = " ".join(f"{a:.2f}" for a in c["vllm"]["acceptance_per_position"]) or "-"
            lines.append(f"| {e['label']} | {s} | {_f(c['vllm']['tau'], '.3f')} | {ours} | {agree} | {lossless} | "
                         f"{acc} | {t['spec_tokens_per_s']:.0f} / {t['base_tokens_per_s']:.0f} |")
    lines += contamination.markdown_lines(res)
    notes = [w for e in rows for w in e.get("warnings") or []] + first_answer_notes(res)
    if res.get("baselines"):
        notes.append(BASELINE_NOTE)
    notes += sorted({c["throughput"]["note"] for e in rows for c in e["sets"].values()
                     if c["throughput"]["note"]})
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"

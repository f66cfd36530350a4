"""Run one command while an engine serves a model: ``python -m dflash_prep.engine.with_server``.

For recipes in shell (``train/recipes/demo_real.sh``): ``regenerate --engine openai`` needs a
server, and a shell that starts one in the background (``vllm serve ... &``) leaves it running
when the shell is killed. This starts it through :func:`~dflash_prep.engine.vllm_server.vllm_server`
instead, so it gets that function's guards (its own process group, a watchdog, a parent-death
signal: it never outlives this process, however this one ends; docs/engines.md#process-lifetime)
and its CPU settings (fp32, eager, 1 GiB of KV cache), waits for ``/health``, runs the command,
and stops the server when the command ends::

    python -m dflash_prep.engine.with_server MODEL --log serve.log [--max-num-seqs 64] -- \\
        dflash-prep regenerate prompts.jsonl --base-url {base_url}/v1 --model {model} ...

In the command, ``{base_url}`` becomes the server's ``http://127.0.0.1:PORT`` and ``{model}`` the
name it serves the model under (the folder's path, as vLLM names it). The exit status is the
command's; a server that fails to start is one line (the engine's own message and the log's path)
and exit status 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from dflash_prep.engine.vllm_server import vllm_server
from dflash_prep.errors import EngineError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_prep.engine.with_server", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the model folder to serve (a transformers folder)")
    p.add_argument("--log", required=True, help="the server's log file")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests the server runs at once")
    p.add_argument("--max-model-len", type=int, default=2048, help="the server's context length")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the server may take to become healthy")
    p.epilog = "-- then the command to run; {base_url} and {model} in it are filled in"
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        p.error("no command to run: give it after --")
    cut = argv.index("--")             # ours before it, the command's own options after it
    args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
    try:
        with vllm_server(args.model, log=args.log, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         timeout_s=args.timeout) as srv:
            print(f"serving {args.model} at {srv.base_url} ({srv.version}, healthy after {srv.start_s:.1f} s)",
                  flush=True)
            filled = [a.replace("{base_url}", srv.base_url).replace("{model}", srv.model) for a in command]
            return subprocess.run(filled).returncode
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

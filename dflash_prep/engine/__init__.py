"""Serving engines: run an exported drafter in the engine users deploy it with, and measure it.

- :mod:`.env`: where the engine's own venv is (``make venv-vllm``) and which vLLM it holds;
- :mod:`.vllm_server`: start ``vllm.entrypoints.openai.api_server`` in its own process group,
  wait for it, read its speculative-decoding counters, stop every process it started;
- :mod:`.evaluate`: ``dflash-prep evaluate``: an export served by vLLM with and without
  speculation: strict load, lossless, tau from the engine's counters, beside our own evaluator;
- :mod:`.load_report`: runs *inside* vLLM (a ``vllm.general_plugins`` entry point) and reports
  which export tensors the engine used and which draft parameters it left unloaded.

Importing this package (and every module but ``load_report``'s :func:`register`) imports the
standard library and numpy only: vLLM and torch live in the engine's processes
(docs/engines.md).
"""

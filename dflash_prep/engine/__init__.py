"""Serving engines: run an exported drafter, or the target itself, in the engine users deploy it with.

- :mod:`.backends`: one record per serving engine, found by name (:mod:`.backends.vllm` holds
  everything that is vLLM's: its venv, server command, metric names, speculative methods, states
  worker); the generic modules below ask it by name (docs/engines.md#adding-an-engine);
- :mod:`.env`: where an engine's own venv is (``make venv-vllm``) and which version it holds;
- :mod:`.lifetime`: the one way an engine process is started (:func:`~.lifetime.spawn`): its own
  process group, a watchdog and a parent-death signal, stopped on SIGTERM and SIGINT: no engine
  process outlives the command that started it;
- :mod:`.vllm_server`: start an engine's server (vLLM's ``vllm.entrypoints.openai.api_server``) in
  its own process group, wait for it, read its speculative-decoding counters, stop every process it started;
- :mod:`.evaluate`: ``dflash-prep evaluate``: an export served by vLLM with and without
  speculation: strict load, lossless, tau from the engine's counters, beside our own evaluator.
  Its parts: :mod:`.method` (the method and k an export asks for), :mod:`.load_check` (the
  strict-load verdict and the diagnosis of a refused load), :mod:`.prompts` (the prompt token
  ids), :mod:`.ours` (our evaluator beside the engine) and :mod:`.report_table` (the printed rows);
- :mod:`.serving_mode`: the serving (thinking) mode and chat-template hash an export was trained
  with (its ``config.json`` ``dflash_prep`` block): ``evaluate --thinking auto`` and its warnings;
- :mod:`.load_report`: runs *inside* vLLM (a ``vllm.general_plugins`` entry point) and reports
  which export tensors the engine used and which draft parameters it left unloaded;
- :mod:`.extract`: ``dflash-prep extract``: the target's hidden states from vLLM, written once
  into a states cache (:mod:`dflash_prep.formats.states`) that the trainer reads every epoch
  (``--target-engine vllm --states CACHE``); :mod:`.states_worker` is its engine side, run with
  the engine's python, :mod:`.worker_pipe` the pipe to it, and :mod:`.states_connector` the KV
  connector vLLM loads to hand the states over (docs/states.md); :mod:`.nodes` splits one build
  over machines (``--node-rank i --num-nodes N``: each node's share of the shards, one folder);
- :mod:`.states_stream`: the same worker serving a micro-batch's states when the trainer asks,
  with no cache (``--target-engine vllm`` without ``--states``, :mod:`dflash_prep.train.engine_taps`).

Importing this package (and every module but ``load_report``'s :func:`register`,
:mod:`.states_worker` and :mod:`.states_connector`) imports the standard library and numpy only:
vLLM and torch live in the engine's processes (docs/engines.md).
"""

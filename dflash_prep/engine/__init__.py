"""Serving engines: the target model run in the engine users serve it with.

- :mod:`.states_env`: where the engine's own venv is (``$DFLASH_PREP_VLLM_PYTHON``, else
  ``.venv-vllm``), and which vLLM it holds;
- :mod:`.extract`: ``dflash-prep extract``: the target's hidden states from vLLM, written once
  into a states cache (:mod:`dflash_prep.formats.states`) that the trainer reads every epoch
  (``--target-engine vllm --states CACHE``);
- :mod:`.states_worker`: the engine side of it, run with the engine's python;
- :mod:`.states_connector`: the KV connector vLLM loads to hand the states over.

Importing this package (and :mod:`.states_env`, :mod:`.extract`) imports the standard library and
numpy only: vLLM and its torch live in the engine's processes (docs/states.md).
"""

"""A thin trainer that proves the pipeline: shards + manifests in, real tokens/s out.

Data flow, one module per step::

    source.py   dataset (mmap'd Arrow shards), plan.json, manifest.open(epoch)   [pack on the fly if missing]
      -> data.py      this rank's micro-batches in manifest order -> tensors (labels shifted per sample)
                      -> Prefetcher: one background thread, bounded FIFO queue
      -> loop.py      per step: all-reduce the normaliser N (targets or sum w), backward(sum / N), all-reduce grads, AdamW
                      -> log.jsonl, progress bar, summary.json; checkpoint.py (atomic, run-key guarded)
      -> objectives/  what is trained, one folder per objective (registry.py finds it by name):
                        lm/ (model.py's decoder, or --init-from a transformers folder), dflash/,
                        dflash2/, eagle3/ (drafters on target.py's frozen model; split/ puts that
                        target on ranks of its own); head + CE in chunks (chunked_ce.py)
      -> objectives/lm/model.py  Llama-style decoder; attention from kernels/ (Triton on CUDA,
                      reference on CPU); RMSNorm, RoPE, SwiGLU from layers.py (shared with the drafters)
      -> export.py, speculate.py  a drafter run's export and its acceptance (the objective's hooks)

``python -m dflash_prep.train`` is the entry point (``make train`` runs it under torchrun);
``python -m dflash_prep.train.bench`` measures tokens/s per batching strategy. Importing ``dflash_prep``
never imports this package, so the ``dflash-prep`` CLI stays free of torch.
"""

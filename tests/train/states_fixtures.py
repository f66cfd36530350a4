"""A states cache written from the transformers target (FrozenTarget), for the trainer's tests of
``--target-engine vllm`` without vLLM (the engine tests in tests/engine/ build real ones).

:func:`cache_from_target` runs the target over the micro-batches of a manifest epoch exactly as the
colocated trainer does (packed documents, the same forward), and stores each document's slice: a
trainer reading this cache over that epoch gets, bit for bit, the taps its own target would have
computed. Samples no micro-batch holds are run alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dflash_prep.formats import states as fmt
from dflash_prep.formats.fileio import atomic_write_json


def cache_from_target(out: Path, source, target, taps, *, final: bool, dtype: str = "fp32", epoch: int = 0,
                      shard_tokens: int = 400, data_path: str | None = None) -> fmt.StatesKey:
    """Write a complete cache of ``taps`` (our ids; + the final state) of ``source``'s dataset."""
    from dflash_prep.train.data import read_documents
    from dflash_prep.formats.target import target_identity
    from dflash_prep.train.target import FrozenTarget

    ds = source.dataset
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stored = tuple(sorted(set(int(t) for t in taps)))
    ft = FrozenTarget(target, list(stored), device=torch.device("cpu"))
    key = fmt.StatesKey(dataset_fingerprint=ds.fingerprint, target_fingerprint=target_identity(target)["target_fingerprint"],
                        taps=stored, final=final, dtype=dtype, hidden=int(ft.config.hidden_size))
    per: dict[int, torch.Tensor] = {}

    def run(mb_like):
        d = read_documents(ds, mb_like, epoch=epoch, vocab_size=int(ft.config.vocab_size))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        got = ft.features(t(d.ids), t(d.pos), t(d.cu.astype(np.int32)), int(d.lens.max()), final=True)
        taps_, last = got
        T = taps_.shape[0]
        x = taps_.view(T, len(stored), -1)                                        # (T, k, H)
        x = torch.cat([x, last[:, None]], 1) if final else x                      # (T, S, H)
        for i, sid in enumerate(d.sids):
            per[int(sid)] = x[int(d.cu[i]):int(d.cu[i + 1])].clone()

    m = source.manifest(epoch)
    for rank in range(m.world_size):
        for mb in m.microbatches(rank):
            run(mb)

    class _One:
        step = rank = accum = 0

        def __init__(self, sid):
            self.sample_ids = np.array([sid])

    for sid in range(len(ds.lengths)):
        if sid not in per:
            run(_One(sid))
    lens = np.asarray(ds.lengths, np.int64)
    plan = fmt.plan_shards(lens, key.bytes_per_token(), shard_tokens * key.bytes_per_token())
    entries = []
    for k, (a, b) in enumerate(plan):
        rows, scales = fmt.encode_torch(torch.cat([per[s] for s in range(a, b)]), dtype)
        off = np.concatenate([[0], np.cumsum(lens[a:b])]).astype(np.int64)
        entries.append(fmt.write_shard(out / fmt.shard_name(k), cache_fingerprint=key.fingerprint(), index=k,
                                       samples=(a, b), key=key, rows=rows, scales=scales, offsets=off))
    atomic_write_json(out / fmt.HEADER_FILE, {
        "complete": True, "fingerprint": key.fingerprint(), "key": key.to_dict(), "plan": [list(p) for p in plan],
        "shards": entries, "dataset": {"path": data_path or "?"}, "engine": {"name": "transformers (test fixture)"},
        "command": "dflash-prep extract (test fixture)"}, format=fmt.FORMAT, version=fmt.VERSION)
    return key


def run_losses(out: Path) -> list[float]:
    """Every step's loss of a finished run, from its ``log.jsonl``."""
    import json

    return [json.loads(x)["loss"] for x in (Path(out) / "log.jsonl").read_text().splitlines()[1:]]


def run_params(out: Path) -> dict:
    """The drafter's weights in a run's checkpoint."""
    from dflash_prep.train import checkpoint as ckpt

    return torch.load(Path(out) / ckpt.CKPT_FILE, weights_only=True)["model"]


def assert_same_drafter(a: Path, b: Path) -> tuple[dict, dict]:
    """Runs ``a`` and ``b`` trained the same drafter bit for bit: every logged loss, every weight.
    Returns their checkpoints' run contracts."""
    from dflash_prep.train import checkpoint as ckpt

    assert run_losses(a) == run_losses(b)
    pa, pb = run_params(a), run_params(b)
    assert pa.keys() == pb.keys()
    for n in pa:
        assert torch.equal(pa[n], pb[n]), f"{n}: max diff {(pa[n] - pb[n]).abs().max().item()}"
    return tuple(ckpt.load(Path(x) / ckpt.CKPT_FILE)["run_key"]["contract"] for x in (a, b))


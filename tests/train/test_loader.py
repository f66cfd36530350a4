"""ManifestLoader: the manifests as a torch IterableDataset for other trainers, with exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_prep.errors import ConfigError, FingerprintMismatch, FormatError
from dflash_prep.formats import lengths as lengths_mod
from dflash_prep.formats import plan as plan_mod
from dflash_prep.pack.pack import pack_epochs
from dflash_prep.synth.synth import SynthConfig, synth
from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize
from dflash_prep.train.loader import ManifestLoader


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    synth(SynthConfig(out=root / "corpus", n=60, seed=3))
    tokenize(TokenizeConfig(tokenizer="byte", inputs=(str(root / "corpus" / "chat.jsonl"),), out=root / "data", max_len=160))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(80,), budget=plan_mod.Budget(value=480), seed=1),
                  root / "plan")
    for layout in ("padded", "varlen"):
        pack_epochs(plan=root / "plan" / "plan.json", epochs=[0, 1], out=root / f"man-{layout}", world_size=2,
                    grad_accum=2, layout=layout, data=root / "data")
    return root


def _loader(root, layout="padded", rank=0, **kw):
    kw.setdefault("epochs", 2)
    return ManifestLoader.from_paths(root / "data", root / "plan" / "plan.json", root / f"man-{layout}", rank=rank,
                                     world_size=2, **kw)


def _key(b):
    return b["input_ids"].numpy().tobytes()


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_hf_collation_matches_the_dataset(pipe, layout):
    from dflash_prep.formats.dataset import open_dataset

    ds = open_dataset(pipe / "data")
    loader = _loader(pipe, layout, collate="trainer")
    hf = _loader(pipe, layout)
    for b, h in zip(loader, hf):
        for r, sid in enumerate(b.sample_ids):
            ids, mask = ds.sample(int(sid))
            if layout == "padded":
                row_ids, row_lab = h["input_ids"][r], h["labels"][r]
                n = len(ids)
                assert h["attention_mask"][r].sum() == n and not h["attention_mask"][r, n:].any()
            else:
                c = b.cu_seqlens
                row_ids, row_lab = h["input_ids"][0, c[r]:c[r + 1]], h["labels"][0, c[r]:c[r + 1]]
                assert torch.equal(h["position_ids"][0, c[r]:c[r + 1]], torch.arange(len(ids)))
                n = len(ids)
            assert np.array_equal(row_ids[:n].numpy(), ids)
            want = np.where(mask != 0, ids, -100).astype(np.int64)
            want[0] = -100          # the first token is never a target (nothing precedes it)
            assert np.array_equal(row_lab[:n].numpy(), want)
        assert h["num_items_in_batch"] == b.n_targets == int((h["labels"] != -100).sum())


def test_yields_this_ranks_microbatches_in_manifest_order_over_epochs(pipe):
    from dflash_prep.formats import manifest

    got = [b.sample_ids.tolist() for b in _loader(pipe, rank=1, collate="trainer")]
    want = []
    for e in (0, 1):
        m = manifest.open(manifest.epoch_dir(pipe / "man-padded", e))
        want += [mb.sample_ids.tolist() for mb in m.microbatches(1)]
    assert got == want and len(got) > 4


@pytest.mark.parametrize("cut", [1, 2, 3, 7])
def test_state_dict_resumes_at_the_next_microbatch(pipe, cut):
    straight = [_key(b) for b in _loader(pipe, "varlen")]
    first = _loader(pipe, "varlen")
    it = iter(first)
    head = [_key(next(it)) for _ in range(cut)]
    state = first.state_dict()
    again = _loader(pipe, "varlen")
    again.load_state_dict(state)
    assert head + [_key(b) for b in again] == straight


def test_plain_loop_two_steps_then_resume_is_bitwise(pipe, tmp_path):
    """A user's own loop: A=2 accumulation, loss / the step's targets, checkpoint, resume."""
    vocab = 259

    def model_and_opt():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def run(loader, model, opt, steps):
        it = iter(loader)
        for _ in range(steps):
            micro = [next(it), next(it)]                       # grad_accum = 2
            n = sum(b["num_items_in_batch"] for b in micro)
            opt.zero_grad()
            for b in micro:
                logits = model(b["input_ids"])[..., :-1, :]     # HF-style: the model shifts
                ce = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), b["labels"][..., 1:].reshape(-1),
                                                       ignore_index=-100, reduction="sum")
                (ce / n).backward()
            opt.step()

    m1, o1 = model_and_opt()
    run(_loader(pipe), m1, o1, 4)

    m2, o2 = model_and_opt()
    loader = _loader(pipe)
    run(loader, m2, o2, 2)
    ckpt = tmp_path / "ck.pt"
    torch.save({"model": m2.state_dict(), "opt": o2.state_dict(), "data": loader.state_dict()}, ckpt)
    state = torch.load(ckpt)
    m3, o3 = model_and_opt()
    m3.load_state_dict(state["model"])
    o3.load_state_dict(state["opt"])
    resumed = _loader(pipe)
    resumed.load_state_dict(state["data"])
    run(resumed, m3, o3, 2)
    for a, b in zip(m1.parameters(), m3.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def test_bad_states_and_options_are_refused(pipe):
    loader = _loader(pipe)
    state = loader.state_dict()
    with pytest.raises(FormatError, match="state_dict"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(FingerprintMismatch, match="plan"):
        loader.load_state_dict({**state, "plan_fingerprint": "0" * 32})
    with pytest.raises(ConfigError, match="rank 1"):
        loader.load_state_dict({**state, "rank": 1})
    with pytest.raises(ConfigError, match="world size 2"):
        next(iter(ManifestLoader.from_paths(pipe / "data", pipe / "plan" / "plan.json", pipe / "man-padded",
                                            world_size=1, epochs=1)))
    with pytest.raises(ConfigError, match="collate"):
        _loader(pipe, collate="nope")
    with pytest.raises(ConfigError, match="epochs"):
        _loader(pipe, epochs=[1, 0])

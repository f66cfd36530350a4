"""The DFlash mask token on a target with a full vocabulary (no spare embedding row, no mask token):
an unused special token is chosen from the data's id counts, recorded in the run and the export,
kept on resume; an id that occurs in the data, or no eligible id at all, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.errors import ConfigError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"]
"""ids 0..5: pad, the template's two, then three special tokens no template emits."""
USED, CHOSEN = 3, 4          # <repo_name> occurs in the data; <reponame> is the lowest one that does not


def _target(out: Path) -> Path:
    """A tiny Qwen3 whose embedding has exactly ``len(tokenizer)`` rows and no mask token."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from dflash_prep.train.target_init import CHAT_TEMPLATE, default_texts

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(default_texts(20_000), trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token=None, bos_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *SPECIALS[3:]]})
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _data(root: Path, target: Path, specials: list[str]) -> dict:
    """Plain-text samples, some holding ``specials``; tokenize -> plan -> pack --objective dflash."""
    from dflash_prep.formats import lengths as lengths_mod
    from dflash_prep.formats import plan as plan_mod
    from dflash_prep.objectives.dflash import drafter_options
    from dflash_prep.pack.pack import PackConfig, pack_epochs
    from dflash_prep.tokenize.tokenize import TokenizeConfig, tokenize

    from dflash_prep.train.target_init import default_texts

    texts = default_texts(12_000)
    rows = [{"text": (specials[i // 3 % len(specials)] + " " if i % 3 == 0 else "") + t[:300]}
            for i, t in enumerate(texts)]
    root.mkdir(parents=True)
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenize(TokenizeConfig(inputs=(str(root / "in.jsonl"),), out=root / "data", tokenizer=str(target), format="text",
                            max_len=128, on_overflow="truncate"))
    src = lengths_mod.load(data=root / "data")
    plan_mod.save(plan_mod.Plan(data=src.describe(), boundaries=(), budget=plan_mod.Budget(value=256), seed=3),
                  root / "plan")
    d = drafter_options(target_config=target, draft_layers=1, block_size=4, max_anchors=6, sliding_window=0)
    pack_epochs(plan=root / "plan" / "plan.json", epochs=[0], out=root / "man",
                config=PackConfig(objective="dflash", options=d, world_size=1, grad_accum=1))
    return {"data": str(root / "data"), "plan": str(root / "plan" / "plan.json"), "manifests": str(root / "man")}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("mask")
    target = _target(root / "target")
    return {"root": root, "target": target, **_data(root / "one", target, [SPECIALS[USED]])}


def _cfg(full, out, **kw):
    from dflash_prep.tests.train.dflash_fixtures import dflash_cfg

    base = dict(data=full["data"], plan=full["plan"], manifests=full["manifests"], draft_layers=1, mask_token_id=None,
                block_size=None, max_anchors=None)
    return dflash_cfg(out, full["target"], **{**base, **kw})


def _mask_line(out: str) -> str:
    [line] = [ln for ln in out.splitlines() if ln.startswith("mask token:")]
    return line


def test_full_vocabulary_picks_the_unused_special_token(full):
    from dflash_prep.formats.target import load_tokenizer
    from dflash_prep.formats.token_counts import id_counts
    from dflash_prep.train.objectives.dflash.mask import choose_mask_token, special_candidates

    tok = load_tokenizer(full["target"])
    assert len(tok) == 300 and tok.mask_token_id is None and "<|mask|>" not in tok.get_vocab()
    assert special_candidates(tok, 300) == [3, 4, 5]      # pad, eos and the template's <|im_start|> left out
    counts = id_counts(full["data"])
    assert counts.of(USED) > 0 and counts.of(CHOSEN) == 0 and (Path(full["data"]) / "id_counts.npy").is_file()
    c = choose_mask_token(tok, 300, data=full["data"])
    assert (c.id, c.token, c.why) == (CHOSEN, "<reponame>", "unused special token")
    assert c.line() == f"mask token: id 4 '<reponame>' (unused special token, 0 of {counts.total} tokens in " \
                       f"{full['data']})"
    # without the data, the lowest candidate: the batch refusal is then the only check
    assert choose_mask_token(tok, 300).id == USED


def test_chosen_id_trains_is_exported_and_survives_resume(full, tmp_path, capsys):
    import torch

    from dflash_prep.train import checkpoint as ckpt
    from dflash_prep.train.export import export
    from dflash_prep.train.loop import train

    out = tmp_path / "run"
    s = train(_cfg(full, out, max_steps=2))
    line = _mask_line(capsys.readouterr().out)
    assert line.startswith("mask token: id 4 '<reponame>' (unused special token, 0 of ") and "\n" not in line
    assert s["global_step"] == 2 and s["anchors"] > 0
    state = ckpt.load(out / ckpt.CKPT_FILE)
    assert state["run_key"]["contract"]["mask_token_id"] == CHOSEN
    assert state["model_config"]["mask_token_id"] == CHOSEN
    export(out, tmp_path / "export")
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == CHOSEN
    # resume: the recorded id, not a new decision (the counts are not even read)
    from dflash_prep.formats import token_counts

    def no_counts(folder):
        raise AssertionError("a resumed run decided its mask token again")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(token_counts, "id_counts", no_counts)
        s = train(_cfg(full, out, max_steps=3))
    assert s["global_step"] == 3 and s["steps"] == 1
    assert _mask_line(capsys.readouterr().out) == f"mask token: id 4 '<reponame>' (recorded in " \
                                                 f"{out / ckpt.CKPT_FILE}, not decided again)"
    assert torch.load(out / ckpt.CKPT_FILE, weights_only=True)["run_key"]["contract"]["mask_token_id"] == CHOSEN


def test_an_explicit_id_that_occurs_in_the_data_is_refused_with_its_count(full, tmp_path):
    from dflash_prep.formats.token_counts import id_counts
    from dflash_prep.train.loop import train

    n = id_counts(full["data"]).of(USED)
    with pytest.raises(ConfigError) as e:
        train(_cfg(full, tmp_path / "run", max_steps=1, mask_token_id=USED))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--mask-token-id 3 '<repo_name>' occurs {n} times in {full['data']}")


def test_no_eligible_id_says_what_to_pass(full, tmp_path):
    from dflash_prep.formats.target import load_tokenizer
    from dflash_prep.train.objectives.dflash.mask import choose_mask_token

    every = _data(tmp_path / "all", full["target"], SPECIALS[3:])
    with pytest.raises(ConfigError) as e:
        choose_mask_token(load_tokenizer(full["target"]), 300, data=every["data"])
    msg = str(e.value)
    assert "\n" not in msg and "no special token unused in" in msg and msg.endswith(
        "pass --mask-token-id with an id that never occurs in the data")
    assert "3 '<repo_name>' x" in msg

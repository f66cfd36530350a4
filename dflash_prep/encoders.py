"""Tokenizers for ``tokenize``: a built-in byte-level one, or a local Hugging Face one.

A chat sample reaches the tokenizer as *segments*: ``[(text, trainable), ...]`` whose
concatenation is the rendered conversation (see :func:`render_chat`). Both
tokenizers return ``(input_ids int32, loss_mask uint8)`` of equal length, where a token's
mask is 1 exactly when it comes from a trainable segment:

- :class:`ByteTokenizer` (``--tokenizer byte``, needs no files): ids 0-255 are the UTF-8
  bytes, then three special tokens ``<|endoftext|>`` (256, eos and pad), ``<|im_start|>``
  (257) and ``<|im_end|>`` (258). A segment whose whole text is a special token's string
  becomes that one id; any other text is bytes, so content can never inject a control
  token. Segments are encoded on their own and concatenated, which for a byte-level code is
  identical to encoding the joined text (``to_tokenizers()`` builds the equivalent
  ``tokenizers`` object; the tests check that the ids agree). Each segment is one
  ``str.encode`` plus a NumPy cast, a few microseconds of Python per segment; in
  ``bench/tokenize_speed.py`` the whole stage with it outruns ``tokenizers``'
  ``encode_batch`` with the equivalent byte-level tokenizer several-fold (README).
- :class:`HFTokenizer` (a local folder with ``tokenizer.json``, or a bare
  ``tokenizer.json``): the joined text is encoded at once with ``encode_batch`` (Rust,
  all cores), so merges across segment borders happen exactly as at inference. The mask
  marks every token that overlaps a trainable character span (``_token_range``): a token
  that straddles a border is trained on. That costs a few ``char_to_token`` Python
  calls per span, not per token. A chat template comes from ``tokenizer_config.json``
  (``chat_template``) or ``chat_template.jinja`` beside it.

Chat rendering (:func:`render_chat`): without a template of its own, a tokenizer gets the
built-in ChatML layout ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, where
an assistant's content and its ``<|im_end|>`` are trainable and everything else is not.
With a Jinja template, the conversation is rendered once (through transformers' own
compiler when installed, so ``{% generation %}`` and ``raise_exception`` work) and every
assistant content is located, in order, in the rendered text; its span, extended over one
special token that immediately follows it (the end-of-turn), is trainable. A template that
rewrites assistant content beyond stripping whitespace cannot be aligned and is an error.

The fingerprint of a tokenizer covers its vocabulary, merges, normalizer and special
tokens (the serialized ``tokenizer.json``) plus its chat template, so a dataset built with
another tokenizer or template is never mistaken for this one. Nothing here reaches a hub:
a path that does not exist locally is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import ConfigError, InputError
from .fileio import fingerprint_bytes

BYTE_NAME = "byte"
Segments = Sequence[tuple[str, bool]]


@dataclass(frozen=True)
class TokenizerInfo:
    """What a trainer needs to know about the tokenizer that built a dataset.

    Attributes:
        name: ``"byte"`` or the local path it was loaded from.
        vocab_size: number of ids, special tokens included (ids are < vocab_size).
        pad_id: id used to pad batches.
        eos_id: end-of-sequence id appended to plain-text samples.
        bos_id: beginning-of-sequence id, or None when the tokenizer has none.
        fingerprint: digest of the tokenizer and its chat template.
    """

    name: str
    vocab_size: int
    pad_id: int
    eos_id: int | None
    bos_id: int | None
    fingerprint: str

    def __post_init__(self):
        if self.vocab_size < 1:
            raise ConfigError(f"tokenizer {self.name}: vocab_size must be positive, got {self.vocab_size}")
        for key in ("pad_id", "eos_id", "bos_id"):
            v = getattr(self, key)
            if v is not None and not 0 <= v < self.vocab_size:
                raise ConfigError(f"tokenizer {self.name}: {key}={v} is outside the vocabulary (size {self.vocab_size})")

    def to_dict(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "pad_id": self.pad_id,
                "eos_id": self.eos_id, "bos_id": self.bos_id, "fingerprint": self.fingerprint}


def _concat(parts_ids: list[np.ndarray], parts_mask: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    if not parts_ids:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    return np.concatenate(parts_ids), np.concatenate(parts_mask)


class ByteTokenizer:
    """The built-in byte-level tokenizer (see the module docstring for the id layout)."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    chat_template: str | None = None
    special_strings: tuple[str, ...] = SPECIALS

    def __init__(self):
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.info = TokenizerInfo(
            name=BYTE_NAME, vocab_size=256 + len(self.SPECIALS), pad_id=256, eos_id=256, bos_id=None,
            fingerprint=fingerprint_bytes("dflash-prep/byte-tokenizer/v1", *self.SPECIALS),
        )

    def encode_text(self, text: str) -> np.ndarray:
        """Bytes of ``text`` as int32 ids; a text equal to a special token is that one id."""
        sid = self._special_ids.get(text)
        if sid is not None:
            return np.array([sid], np.int32)
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_segments_batch(self, batch: list[Segments], *, chat: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        """Encode rendered samples; plain text (``chat=False``) also gets EOS, trained on."""
        out = []
        for segs in batch:
            ids, masks = [], []
            for text, trainable in segs:
                t = self.encode_text(text)
                ids.append(t)
                masks.append(np.full(t.shape[0], trainable, np.uint8))
            if not chat:
                ids.append(np.array([self.info.eos_id], np.int32))
                masks.append(np.ones(1, np.uint8))
            out.append(_concat(ids, masks))
        return out

    def to_tokenizers(self):
        """The equivalent ``tokenizers.Tokenizer`` (same ids on text), for checks and benchmarks."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins, one per byte
        byte_to_char = _bytes_to_unicode()
        vocab = {byte_to_char[b]: b for b in range(256)}
        if set(vocab) != set(alphabet):
            raise ConfigError("tokenizers' ByteLevel alphabet differs from GPT-2's byte map; update dflash-prep")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in self.SPECIALS])
        return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class HFTokenizer:
    """A local ``tokenizers`` tokenizer plus its optional chat template."""

    def __init__(self, path: Path, tok, config: dict, chat_template: str | None):
        self.path = path
        self.tok = tok
        self.config = config
        self.chat_template = chat_template
        added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self.special_strings = tuple(sorted((a.content for a in added.values() if a.special), key=len, reverse=True))
        self.special_map = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        eos_id = self._id_of(self.special_map["eos_token"], ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"))
        bos_id = self._id_of(self.special_map["bos_token"], ("<s>", "<|begin_of_text|>", "<bos>"))
        pad_id = self._id_of(self.special_map["pad_token"], ("<pad>", "<|pad|>"))
        if pad_id is None:
            pad_id = eos_id if eos_id is not None else 0
        fp = fingerprint_bytes("dflash-prep/hf-tokenizer/v1", tok.to_str(), chat_template or "",
                               json.dumps(self.special_map, sort_keys=True))
        self.info = TokenizerInfo(name=str(path), vocab_size=int(tok.get_vocab_size(with_added_tokens=True)),
                                  pad_id=int(pad_id), eos_id=eos_id, bos_id=bos_id, fingerprint=fp)

    def _id_of(self, configured: str | None, fallbacks: tuple[str, ...]) -> int | None:
        for s in ((configured,) if configured else ()) + fallbacks:
            i = self.tok.token_to_id(s)
            if i is not None:
                return int(i)
        return None

    def encode_segments_batch(self, batch: list[Segments], *, chat: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        texts = ["".join(t for t, _ in segs) for segs in batch]
        # Plain text gets the tokenizer's own special tokens (e.g. BOS) and an EOS; a
        # rendered chat already carries whatever its template put there.
        encs = self.tok.encode_batch(texts, add_special_tokens=not chat)
        eos_id = self.info.eos_id
        out = []
        for segs, enc, text_all in zip(batch, encs, texts):
            ids = np.array(enc.ids, np.int32)
            if not chat:
                mask = np.ones(ids.shape[0], np.uint8)  # plain text: every token is trained on
                if eos_id is not None and (ids.shape[0] == 0 or ids[-1] != eos_id):
                    ids = np.append(ids, np.int32(eos_id))
                    mask = np.append(mask, np.uint8(1))
                out.append((ids, mask))
                continue
            mask = np.zeros(ids.shape[0], np.uint8)
            pos = 0
            for text, trainable in segs:
                end = pos + len(text)
                if trainable and end > pos:
                    lo, hi = _token_range(enc, pos, end, len(text_all))
                    mask[lo:hi] = 1
                pos = end
            out.append((ids, mask))
        return out


def _token_range(enc, start: int, end: int, n_chars: int) -> tuple[int, int]:
    """Token index range ``[lo, hi)`` of the tokens that overlap characters ``[start, end)``.

    ``lo`` is the first token of the first character that has one. ``hi`` is the first
    token of the first character at or after ``end``, plus one when that token starts
    before ``end`` (it straddles the border); without such a character, the token count.
    Per-character lookups, not per-token work: a character split over several byte-level
    tokens maps to its first token, and its later tokens are covered because ``hi`` is
    found from the next character.
    """
    lo = None
    for c in range(start, end):
        lo = enc.char_to_token(c)
        if lo is not None:
            break
    if lo is None:  # the span produced no tokens (e.g. removed by the normalizer)
        return 0, 0
    for c in range(end, n_chars):
        t = enc.char_to_token(c)
        if t is not None:
            return lo, t + 1 if enc.token_to_chars(t)[0] < end else t
    return lo, len(enc)


def _token_str(v) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_template(folder: Path, config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` for the built-in tokenizer, else a local folder or ``tokenizer.json`` path."""
    if spec == BYTE_NAME:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--tokenizer {spec}: no such local file or folder. dflash-prep never downloads; "
            "pass a folder holding tokenizer.json (e.g. a downloaded model snapshot), a tokenizer.json, or 'byte'."
        )
    folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
    if not file.is_file():
        raise ConfigError(f"--tokenizer {spec}: {file} not found; the folder needs a tokenizer.json "
                          "(slow/sentencepiece-only tokenizers are not supported; convert with transformers first)")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise InputError(f"{file}: not a valid tokenizer.json ({e}); re-save it with `tokenizers` or transformers") from e
    config = {}
    cfg_file = folder / "tokenizer_config.json"
    if path.is_dir() and cfg_file.is_file():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{cfg_file}: not valid JSON ({e}); fix or remove it") from e
        if not isinstance(config, dict):
            raise InputError(f"{cfg_file}: holds a JSON {type(config).__name__}, not an object of settings; fix or "
                             "remove it")
    template = _read_template(folder, config) if path.is_dir() else None
    return HFTokenizer(path, tok, config, template)


# ----------------------------------------------------------------------------- chat
def render_chat(tokenizer: ByteTokenizer | HFTokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """Render validated ``[{"role", "content"}]`` into trainable/untrainable segments."""
    if tokenizer.chat_template is None:
        segs = []
        for m in messages:
            train = m["role"] == "assistant"
            segs += [("<|im_start|>", False), (m["role"] + "\n", False), (m["content"], train),
                     ("<|im_end|>", train), ("\n", False)]
        return segs
    text = _compiled(tokenizer)(messages)
    segs, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"]:
            continue
        content = m["content"]
        at = text.find(content, pos)
        if at < 0:
            content = content.strip()
            at = text.find(content, pos) if content else -1
        if at < 0:
            raise InputError(
                f"message {i}: the chat template of {tokenizer.info.name} rewrites assistant content, so the "
                "loss mask cannot be aligned; use a template that emits content verbatim"
            )
        end = at + len(content)
        for sp in tokenizer.special_strings:  # longest first
            if text.startswith(sp, end):
                end += len(sp)
                break
        segs += [(text[pos:at], False), (text[at:end], True)]
        pos = end
    segs.append((text[pos:], False))
    return [s for s in segs if s[0]]


def _compiled(tokenizer: HFTokenizer):
    fn = getattr(tokenizer, "_render_fn", None)
    if fn is not None:
        return fn
    kwargs = {k: v for k, v in tokenizer.special_map.items() if v is not None}
    try:
        template = _compile(tokenizer.chat_template)
    except ImportError as e:
        raise ConfigError(f"{tokenizer.info.name} has a chat template, which needs jinja2: "
                          "pip install 'dflash-prep[chat]'") from e
    except Exception as e:  # jinja2's TemplateSyntaxError and friends
        raise InputError(f"{tokenizer.info.name}: its chat template does not compile ({e}); "
                         "fix tokenizer_config.json or chat_template.jinja") from e

    def fn(messages):
        try:
            return template.render(messages=messages, add_generation_prompt=False, **kwargs)
        except Exception as e:  # jinja raises many kinds; the template's own raise_exception among them
            raise InputError(f"the chat template of {tokenizer.info.name} refused the conversation: {e}") from e

    tokenizer._render_fn = fn
    return fn


def _compile(source: str):
    """transformers' own compiler when installed ({% generation %}, raise_exception), else jinja2's sandbox."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        import jinja2.sandbox

        def _raise(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(source)
    return _compile_jinja_template(source)

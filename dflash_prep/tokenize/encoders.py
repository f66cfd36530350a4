"""Tokenizers for ``tokenize``: the built-in byte-level one, or a local Hugging Face folder.

Both expose one interface: ``render(messages, add_generation_prompt) -> (text,
generation_spans)`` for :mod:`dflash_prep.tokenize.chat`, ``encode_rows(rows)`` and
``encode_plain(texts)``, each returning ``(input_ids int32, loss_mask uint8)`` pairs.

- :class:`ByteTokenizer` (``--tokenizer byte``, needs no files): ids 0-255 are the UTF-8
  bytes, then ``<|endoftext|>`` (256, eos and pad), ``<|im_start|>`` (257), ``<|im_end|>``
  (258). Its chat layout is :data:`dflash_prep.tokenize.chat.CHATML_TEMPLATE`, rendered natively
  (:func:`dflash_prep.tokenize.chat.chatml_render`; the tests check it against transformers). The
  encoding is NumPy over ``str.encode``, faster than the equivalent ``tokenizers`` object
  (docs/benchmarks.md#tokenize-throughput); ``to_tokenizers()`` builds the equivalent ``tokenizers`` object.
- :class:`HFTokenizer`: a local folder loaded with ``transformers.AutoTokenizer.
  from_pretrained(path, local_files_only=True)``, so every ``tokenizer_config.json``
  setting applies (``legacy``, ``add_bos_token``, added and special tokens), or a bare
  ``tokenizer.json`` (``PreTrainedTokenizerFast``, no template). Rendering is transformers'
  ``render_jinja_template`` with the tokenizer's ``special_tokens_map``: the same text as
  ``apply_chat_template(messages, tokenize=False)``. Rows are encoded in one
  ``encode_batch`` call on the backend transformers configured (``add_special_tokens=False``,
  as ``apply_chat_template(tokenize=True)`` does), so the ids are transformers' ids.

The loss mask of a row marks every token whose character offsets overlap a trained span:
transformers' rule for ``return_assistant_tokens_mask`` (:func:`overlap_mask`; for a batch
encoding the same ranges come from ``char_to_token`` at the span borders,
:func:`_token_range`, which skips converting every token's offsets).

Content never injects a control token: a row whose text carries the markers of
:func:`dflash_prep.tokenize.chat.mark` is encoded piece by piece with transformers'
``sanitize_control_tokens`` rule: the text between markers as usual (each later piece
after a ``"\\n"`` that is then dropped, so SentencePiece adds no prefix space), each marked
control token as plain text with added tokens disabled. A tokenizer that produces the
control token itself from that plain text is an error for that record.

Fingerprint (:attr:`TokenizerInfo.fingerprint`): SHA-256 of every tokenizer file in the
folder, of the chat template in effect and of the backend transformers built (its
serialized ``tokenizer.json`` and special-token map); the file path is not part of it, so
a moved or copied folder keeps it. Nothing here reaches a hub.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_prep.errors import ConfigError, InputError
from dflash_prep.formats.fileio import fingerprint_bytes, fingerprint_json
from dflash_prep.tokenize.chat import (CHATML_TEMPLATE, MARK_END, MARK_START, MaskOptions, Row, chatml_render,
                                       control_pattern, mark, plan_rows)
from dflash_prep.tokenize.tokenizer_files import check_tokenizer_files

BYTE_NAME = "byte"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TokenizerInfo:
    """What a trainer needs to know about the tokenizer that built a dataset.

    Attributes:
        name: ``"byte"`` or the local path it was loaded from.
        vocab_size: number of ids, special tokens included (ids are < vocab_size).
        pad_id: id used to pad batches.
        eos_id: end-of-sequence id appended to plain-text samples.
        bos_id: beginning-of-sequence id, or None when the tokenizer has none.
        fingerprint: digest of the tokenizer files, the chat template and the built backend.
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


def overlap_mask(starts: np.ndarray, ends: np.ndarray, spans) -> np.ndarray:
    """uint8 mask: token k is 1 iff its ``[starts[k], ends[k])`` overlaps a span.

    Exactly transformers' loop for ``return_assistant_tokens_mask`` (spans in order; a
    pointer advances past spans ending at or before the token's start, never backwards),
    vectorized: ``searchsorted`` on the span ends, then a running maximum.
    """
    n = starts.shape[0]
    if not spans or n == 0:
        return np.zeros(n, np.uint8)
    sp = np.asarray(spans, np.int64).reshape(-1, 2)                      # (S, 2) char offsets
    idx = np.maximum.accumulate(np.searchsorted(sp[:, 1], starts, side="right"))  # (n,) span pointer
    ok = idx < sp.shape[0]
    return (ok & (ends > sp[np.minimum(idx, sp.shape[0] - 1), 0])).astype(np.uint8)


def _token_range(enc, a: int, b: int, n_chars: int, n: int) -> tuple[int, int]:
    """Tokens ``[lo, hi)`` whose offsets overlap characters ``[a, b)``: :func:`overlap_mask`'s
    rule for a batch encoding's ordered offsets, from a few ``char_to_token`` lookups per
    span instead of converting every token's offsets (which costs ~15% of the encode).

    ``lo`` is the first token holding a character of the span (a character split over
    several byte-level tokens maps to its first); ``hi`` is the first token holding a
    character at or after ``b``, plus one when that token starts before ``b`` (it
    straddles the border and overlaps the span), or ``n`` when there is none.
    """
    lo = None
    for c in range(a, b):
        lo = enc.char_to_token(c)
        if lo is not None:
            break
    if lo is None:
        return 0, 0
    for c in range(b, n_chars):
        t = enc.char_to_token(c)
        if t is not None:
            return lo, t + 1 if enc.token_to_chars(t)[0] < b else t
    return lo, n


def template_sha(template: str | None) -> str | None:
    return hashlib.sha256(template.encode()).hexdigest() if template is not None else None


# ----------------------------------------------------------------------------- byte
class ByteTokenizer:
    """The built-in byte-level tokenizer with the built-in ChatML layout (module docstring)."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    has_generation = True
    stable_template = True  # chatml_render never rewrites earlier turns

    def __init__(self):
        self._special_ids = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self.chat_template = CHATML_TEMPLATE
        self.control = control_pattern(self.SPECIALS)
        alt = "|".join(re.escape(s) for s in self.SPECIALS)
        self._split = re.compile(f"{MARK_START}({alt}){MARK_END}|[{MARK_START}{MARK_END}]|({alt})")
        self._specials_b = re.compile(alt.encode())
        self.files: dict[str, str] = {}
        self.info = TokenizerInfo(
            name=BYTE_NAME, vocab_size=256 + len(self.SPECIALS), pad_id=256, eos_id=256, bos_id=None,
            fingerprint=fingerprint_bytes("dflash-prep/byte-tokenizer/v1", *self.SPECIALS),
        )

    def render(self, messages: list, add_generation_prompt: bool):
        return chatml_render(messages, add_generation_prompt)

    def _encode(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ids, token start and end character offsets of ``text`` (templates' specials special,
        marked ones and all other text bytes)."""
        ids, st, en = [], [], []
        pos = 0

        def plain(a: int, b: int) -> None:
            if b <= a:
                return
            piece = text[a:b]
            raw = piece.encode("utf-8")
            ids.append(np.frombuffer(raw, np.uint8).astype(np.int32))
            if len(raw) == len(piece):  # ASCII: one byte per character
                ch = np.arange(a, b, dtype=np.int64)
            else:
                ch = a + np.repeat(np.arange(len(piece), dtype=np.int64), [len(c.encode("utf-8")) for c in piece])
            st.append(ch)
            en.append(ch + 1)

        for m in self._split.finditer(text):
            plain(pos, m.start())
            if m.group(1) is not None:
                plain(m.start(1), m.end(1))
            elif m.group(2) is not None:
                ids.append(np.array([self._special_ids[m.group(2)]], np.int32))
                st.append(np.array([m.start()], np.int64))
                en.append(np.array([m.end()], np.int64))
            pos = m.end()
        plain(pos, len(text))
        if not ids:
            z = np.zeros(0, np.int64)
            return np.zeros(0, np.int32), z, z
        return np.concatenate(ids), np.concatenate(st), np.concatenate(en)

    def _encode_fast(self, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
        """No markers: every special string is the template's. Works in byte offsets: the
        bytes are the ids, each special's bytes collapse into its id; spans are moved to
        byte offsets through a vectorized UTF-8 length table when the text is not ASCII."""
        raw = text.encode("utf-8")
        ids = np.frombuffer(raw, np.uint8).astype(np.int32)   # (B,) one id per byte
        st = np.arange(ids.shape[0], dtype=np.int64)          # (B,) byte start of each token
        en = st + 1
        keep = np.ones(ids.shape[0], bool)
        for m in self._specials_b.finditer(raw):
            a, b = m.span()
            ids[a] = self._special_ids[m.group().decode()]
            keep[a + 1:b] = False
            en[a] = b
        if spans and len(raw) != len(text):
            cp = np.frombuffer(text.encode("utf-32-le"), np.uint32)  # (C,) code points
            blen = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
            cum = np.concatenate([[0], np.cumsum(blen)])             # (C + 1,) char -> byte offset
            spans = [(int(cum[a]), int(cum[b])) for a, b in spans]
        return ids[keep], overlap_mask(st[keep], en[keep], spans)

    def encode_rows(self, rows: list[Row]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for r in rows:
            if r.marked:
                ids, st, en = self._encode(r.text)
                out.append((ids, overlap_mask(st, en, r.spans)))
            else:
                out.append(self._encode_fast(r.text, r.spans))
        return out

    def encode_plain(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Plain text: its bytes (specials too: plain text has no template) plus EOS, all trained."""
        out = []
        for t in texts:
            ids = np.append(np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32), np.int32(self.info.eos_id))
            out.append((ids, np.ones(ids.shape[0], np.uint8)))
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


# ----------------------------------------------------------------------------- Hugging Face
class HFTokenizer:
    """A transformers fast tokenizer loaded from local files, plus the chat template in effect."""

    stable_template = False  # any Jinja template may rewrite earlier turns: checked per conversation

    def __init__(self, path: Path, hf, chat_template: str | None, files: dict[str, str]):
        self.path, self.hf, self.files = path, hf, files
        self.backend = hf.backend_tokenizer
        self.chat_template = chat_template
        self.has_generation = bool(chat_template and _GENERATION_RE.search(chat_template))
        self.template_kwargs = dict(hf.special_tokens_map)
        added = hf.added_tokens_decoder  # id -> AddedToken
        self._added = {a.content: i for i, a in added.items()}
        self.control = control_pattern(_control_tokens(hf, added))
        alt = "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True)) or "(?!)"
        self._markers = re.compile(f"{MARK_START}({alt}){MARK_END}|[{MARK_START}{MARK_END}]")
        self._newline = self.backend.encode("\n", add_special_tokens=False).ids
        eos, bos, pad = hf.eos_token_id, hf.bos_token_id, hf.pad_token_id
        if pad is None:
            pad = eos if eos is not None else 0
        backend_sha = fingerprint_bytes(self.backend.to_str(), json.dumps(self.template_kwargs, sort_keys=True))
        fp = fingerprint_json({"files": files, "chat_template": template_sha(chat_template), "backend": backend_sha})
        self.info = TokenizerInfo(name=str(path), vocab_size=int(len(hf)), pad_id=int(pad),
                                  eos_id=None if eos is None else int(eos), bos_id=None if bos is None else int(bos),
                                  fingerprint=fp)

    def render(self, messages: list, add_generation_prompt: bool):
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, gens = render_jinja_template(
                conversations=[messages], chat_template=self.chat_template,
                return_assistant_tokens_mask=self.has_generation, add_generation_prompt=add_generation_prompt,
                **self.template_kwargs)
        except Exception as e:  # jinja raises many kinds; the template's own raise_exception among them
            raise ValueError(f"the chat template refused the conversation ({type(e).__name__}: {e})") from None
        return texts[0], [tuple(g) for g in gens[0]] if self.has_generation and gens else []

    def encode_rows(self, rows: list[Row]) -> list[tuple[np.ndarray, np.ndarray]]:
        out: list = [None] * len(rows)
        fast = [k for k, r in enumerate(rows) if not r.marked]
        encs = self.backend.encode_batch([rows[k].text for k in fast], add_special_tokens=False) if fast else []
        for k, enc in zip(fast, encs):
            ids = np.asarray(enc.ids, np.int32)
            mask = np.zeros(ids.shape[0], np.uint8)
            n_chars = len(rows[k].text)
            for a, b in rows[k].spans:
                lo, hi = _token_range(enc, a, b, n_chars, ids.shape[0])
                mask[lo:hi] = 1
            out[k] = (ids, mask)
        for k, r in enumerate(rows):
            if r.marked:
                ids, st, en = self._encode_marked(r.text)
                out[k] = (ids, overlap_mask(st, en, r.spans))
        return out

    def _encode_marked(self, text: str):
        """transformers' ``sanitize_control_tokens`` encoding, with offsets in ``text``'s coordinates."""
        pieces, pos = [], 0
        for m in self._markers.finditer(text):
            pieces.append((pos, text[pos:m.start()], False))
            if m.group(1) is not None:
                pieces.append((m.start(1), m.group(1), True))
            pos = m.end()
        pieces.append((pos, text[pos:], False))
        ids, st, en = [], [], []
        nl = self._newline
        try:
            for j, (at, piece, as_text) in enumerate(pieces):
                if j and not piece:
                    continue
                self.backend.encode_special_tokens = as_text
                shift = at
                enc = self.backend.encode("\n" + piece if j else piece, add_special_tokens=False)
                p_ids, p_off = enc.ids, enc.offsets
                if j:
                    if p_ids[: len(nl)] == nl:
                        p_ids, p_off, shift = p_ids[len(nl):], p_off[len(nl):], at - 1
                    else:
                        enc = self.backend.encode(piece, add_special_tokens=False)
                        p_ids, p_off = enc.ids, enc.offsets
                if as_text and self._added.get(piece) in p_ids:
                    raise ValueError(f"content spells {piece!r}, and this tokenizer produces that control token "
                                     "even from plain text, so it cannot be kept as text")
                ids += p_ids
                st += [a + shift for a, _ in p_off]
                en += [b + shift for _, b in p_off]
        finally:
            self.backend.encode_special_tokens = False
        return np.asarray(ids, np.int32), np.asarray(st, np.int64), np.asarray(en, np.int64)

    def encode_plain(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Plain text as ``tokenizer(text)`` encodes it (BOS etc. per its config), plus EOS, all trained."""
        eos = self.info.eos_id
        out = []
        for enc in self.backend.encode_batch(texts, add_special_tokens=True):
            ids = np.asarray(enc.ids, np.int32)
            if eos is not None and (ids.shape[0] == 0 or ids[-1] != eos):
                ids = np.append(ids, np.int32(eos))
            out.append((ids, np.ones(ids.shape[0], np.uint8)))
        return out


def _control_tokens(hf, added: dict) -> list[str]:
    """Control tokens: the added tokens flagged special, plus any listed in ``chat_control_tokens``.

    Non-special added tokens (Qwen3's ``<think>``) are vocabulary that content may use, as
    in transformers' plain ``apply_chat_template``; they are not escaped.
    """
    listed = set(getattr(hf, "chat_control_tokens", None) or ())
    return [a.content for a in added.values() if a.special or a.content in listed]


def tokenizer_file_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of each tokenizer file in ``folder`` (:data:`TOKENIZER_FILES`): what ``meta.json`` records."""
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
            for n in TOKENIZER_FILES if (folder / n).is_file()}


def load_tokenizer(spec: str, *, chat_template: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``"byte"``, or a local folder / ``tokenizer.json``; ``chat_template`` sets or overrides the template."""
    if spec == BYTE_NAME:
        if chat_template is not None and chat_template != CHATML_TEMPLATE:
            raise ConfigError("--tokenizer byte has the built-in ChatML layout only; drop --chat-template "
                              "or pass a tokenizer folder")
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"--tokenizer {spec}: no such local file or folder. dflash-prep never downloads; "
            "pass a folder holding tokenizer.json (e.g. a downloaded model snapshot), a tokenizer.json, or 'byte'."
        )
    try:
        import transformers
        from transformers.utils.chat_template_utils import render_jinja_template  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"--tokenizer {spec}: a Hugging Face tokenizer needs transformers (>= 4.51) and jinja2: "
                          "pip install 'dflash-prep[chat]'") from e
    transformers.logging.set_verbosity_error()
    folder = path if path.is_dir() else path.parent
    if path.is_dir():      # transformers would fail on these with a bare traceback, or not name the field
        check_tokenizer_files(folder)
    try:
        if path.is_dir():
            hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        elif path.name.endswith(".json"):
            hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            raise ConfigError(f"--tokenizer {spec}: pass a tokenizer folder or a tokenizer.json file")
    except ConfigError:
        raise
    except Exception as e:  # transformers/tokenizers raise many kinds for unreadable folders
        raise InputError(f"--tokenizer {spec}: transformers cannot load it ({type(e).__name__}: {_short(e)}); "
                         "the folder needs tokenizer.json or a convertible tokenizer.model with its "
                         "tokenizer_config.json") from e
    if not getattr(hf, "is_fast", False):
        raise ConfigError(f"--tokenizer {spec}: transformers loaded a slow (Python) tokenizer; save it with "
                          "a tokenizer.json (tokenizer.save_pretrained) so the fast backend can be used")
    files = tokenizer_file_hashes(folder) if path.is_dir() else {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    template = chat_template
    if template is None and path.is_dir():
        try:
            template = hf.get_chat_template()
        except ValueError:  # transformers: "Cannot use chat template functions ... no chat template"
            template = None
    return HFTokenizer(path, hf, template, files)


def _short(e: Exception) -> str:
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def encode_chats(tok, conversations: list[list[dict]], opts=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` of every row of validated conversations, in order (for checks and benchmarks).

    The same path as ``tokenize`` (:func:`dflash_prep.tokenize.chat.mark`, :func:`~dflash_prep.tokenize.chat.plan_rows`,
    ``encode_rows``) without files; an expanded conversation contributes several rows.
    """
    opts = opts or MaskOptions()
    rows = []
    for msgs in conversations:
        m, marked = mark(msgs, tok.control)
        rows += plan_rows(m, tok.render, opts, has_generation=tok.has_generation, control=tok.control, marked=marked,
                          stable_template=getattr(tok, "stable_template", False))[0]
    return tok.encode_rows(rows)

"""The settings files of a local tokenizer folder, checked before transformers reads them.

transformers fails on a malformed field with a bare ``TypeError`` (``"chat_template": 42``), a
message that does not name the file, or not at all (a string ``add_bos_token``).
:func:`check_tokenizer_files` refuses each with one line naming the file and the field:
``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.json`` and
``tokenizer.json`` (each a JSON object, its known fields typed as in :data:`_FIELDS`),
``added_tokens.json`` (token -> integer id) and ``chat_template.jinja`` (UTF-8 text). Unknown
fields are left to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_prep.errors import InputError


def _token(v) -> bool:  # a special token: a string, or an AddedToken dict with its content
    return isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("content"), str))


def _template(v) -> bool:  # one Jinja source, or a list of named ones
    return isinstance(v, str) or (isinstance(v, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in v))


def _tokens(v) -> bool:
    return isinstance(v, list) and all(map(_token, v))


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) for t in v)


def _flag(v) -> bool:
    return v is None or isinstance(v, bool)


_SPECIAL = {k: (lambda v: v is None or _token(v), "null, a string or {\"content\": string, ...}")
            for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
_TEMPLATE = {"chat_template": (_template, 'a string (a Jinja template) or a list of {"name", "template"} strings')}
_FIELDS = {
    "tokenizer_config.json": {
        **_SPECIAL, **_TEMPLATE,
        "additional_special_tokens": (_tokens, "a list of special tokens"),
        "extra_special_tokens": (lambda v: _tokens(v) or (isinstance(v, dict) and all(map(_token, v.values()))),
                                 "a list of special tokens or an object of named ones"),
        "added_tokens_decoder": (lambda v: isinstance(v, dict) and all(
            k.isdigit() and isinstance(t, dict) and isinstance(t.get("content"), str) for k, t in v.items()),
            'an object {"ID": {"content": string, ...}}'),
        "chat_control_tokens": (_strings, "a list of strings"),
        "model_input_names": (_strings, "a list of strings"),
        "model_max_length": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                             "a positive number"),
        "tokenizer_class": (lambda v: isinstance(v, str), "a class name (string)"),
        "padding_side": (lambda v: v in ("left", "right"), '"left" or "right"'),
        "truncation_side": (lambda v: v in ("left", "right"), '"left" or "right"'),
        **{k: (_flag, "true, false or null") for k in ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy",
                                                       "clean_up_tokenization_spaces", "split_special_tokens")}},
    "special_tokens_map.json": {**_SPECIAL, "additional_special_tokens": (_tokens, "a list of special tokens")},
    "chat_template.json": _TEMPLATE,
    "added_tokens.json": {},
    "tokenizer.json": {    # the backend itself: the fields whose wrong type tokenizers reports without naming them
        "model": (lambda v: isinstance(v, dict) and isinstance(v.get("type", ""), str), "an object with a \"type\""),
        "added_tokens": (lambda v: isinstance(v, list) and all(
            isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str) for t in v),
            'a list of {"id": integer, "content": string, ...}'),
    },
}


def check_tokenizer_files(folder: Path) -> None:
    """Refuse a malformed settings file of a tokenizer folder with one line naming the file and
    the field: not UTF-8 JSON, not an object, or a field transformers reads with the wrong type
    (:data:`_FIELDS`; ``added_tokens.json`` maps token strings to integer ids)."""
    for name, fields in _FIELDS.items():
        f = folder / name
        if not f.is_file():
            continue
        try:
            obj = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{f}: not valid UTF-8 JSON ({e}); fix or remove it") from e
        if not isinstance(obj, dict):
            raise InputError(f"{f}: holds a JSON {type(obj).__name__}, not an object of settings; fix or remove it")
        bad = [(k, want) for k, (ok, want) in fields.items() if k in obj and not ok(obj[k])]
        if name == "added_tokens.json":
            bad = [(k, "an integer token id") for k, v in obj.items() if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            k, want = bad[0]
            raise InputError(f"{f}: field {k!r} is {_short_json(obj[k])}, expected {want}; fix or remove it")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{jinja}: not UTF-8 text ({e}); fix or remove it") from e


def _short_json(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."

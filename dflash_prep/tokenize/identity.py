"""Was a dataset tokenized for this target? The check ``extract`` and the trainer make before they
run a target over a dataset's token ids (a target's hidden states of another tokenizer's ids are
meaningless, and a cache of them would still verify).

It compares what ``dflash-prep tokenize`` recorded in the dataset's ``meta.json`` (``tokenizer``:
each tokenizer file's SHA-256, hashed by :func:`~dflash_prep.tokenize.encoders.tokenizer_file_hashes`,
and the chat template's) with the target's folder, hashed the same way.
"""

from __future__ import annotations

from pathlib import Path

from dflash_prep.errors import FingerprintMismatch
from dflash_prep.formats.target import load_tokenizer
from dflash_prep.tokenize.encoders import template_sha, tokenizer_file_hashes

VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
"""The files that decide a text's token ids; ``dflash-prep tokenize`` records each one's SHA-256 in
the dataset's ``meta.json`` (``tokenizer.files``)."""


def chat_template_sha256(template: str | None) -> str | None:
    """SHA-256 (hex) of a chat template's text, None for no template: the one hash of a template.

    ``tokenize`` records it for the template it rendered with (``meta.json``
    ``tokenizer.chat_template.sha256`` and ``serving_mode.chat_template_sha256``), the export
    carries it (``config.json`` ``dflash_prep.chat_template_sha256``), and ``evaluate`` compares it
    with its target's (:func:`tokenizer_template_sha256`) to warn of a drafter served under
    another template."""
    return template_sha(template)


def tokenizer_template_sha256(tokenizer) -> str | None:
    """:func:`chat_template_sha256` of a transformers tokenizer's chat template (None: it has none)."""
    return chat_template_sha256(_template_of(tokenizer))


def _template_of(tokenizer) -> str | None:
    """The chat template ``dflash-prep tokenize --tokenizer TARGET`` renders with (None: it has none)."""
    try:
        return tokenizer.get_chat_template()
    except ValueError:                                # transformers: the tokenizer has no chat template
        return None


def _identity_text(name: str, files: dict, template_sha256: str | None) -> str:
    vocab = ", ".join(f"{n} {files[n][:12]}" for n in VOCAB_FILES if n in files) or "no tokenizer files"
    return f"{name} ({vocab}; chat template {template_sha256[:12] if template_sha256 else 'none'})"


def check_tokenizer(data, meta: dict, target, tokenizer=None, *, then: str) -> None:
    """Refuse a dataset tokenized for another model than ``target`` (the target's hidden states of
    those ids would be meaningless, and a cache of them would still verify), in one line naming
    both identities and the ``dflash-prep tokenize`` command that fixes it (``then``: what to do
    with its output).

    The same tokenizer: every vocabulary file (:data:`VOCAB_FILES`) that both the dataset's record
    and the target's folder hold has the same SHA-256, and they share at least one (the byte
    tokenizer has none). The same chat template: the SHA-256 of the template the data was rendered
    with equals that of the target's (``tokenizer``'s, loaded from ``target`` when None). A
    template chosen with ``tokenize --chat-template`` (the record says so) is the user's explicit
    choice, and passes."""
    target = Path(target)
    t = meta.get("tokenizer") or {}
    theirs = {n: h for n, h in (t.get("files") or {}).items() if n in VOCAB_FILES}
    ours = {n: h for n, h in tokenizer_file_hashes(target).items() if n in VOCAB_FILES}
    common = theirs.keys() & ours.keys()
    same_vocab = bool(common) and all(theirs[n] == ours[n] for n in common)
    tmpl = t.get("chat_template") or {}
    target_tmpl = tokenizer_template_sha256(tokenizer if tokenizer is not None else load_tokenizer(target))
    same_template = tmpl.get("source") == "--chat-template" or tmpl.get("sha256") == target_tmpl
    if same_vocab and same_template:
        return
    what = "another vocabulary" if not same_vocab else "another chat template"
    name = "the built-in byte tokenizer" if t.get("name") == "byte" else str(t.get("name") or "an unrecorded tokenizer")
    raise FingerprintMismatch(
        f"{data} was tokenized for another model ({what}): with {_identity_text(name, theirs, tmpl.get('sha256'))}, "
        f"the target has {_identity_text(str(target), ours, target_tmpl)}; re-tokenize it with the target's tokenizer "
        f"(`dflash-prep tokenize INPUTS --tokenizer {target} --out NEW_DATA`){then}")

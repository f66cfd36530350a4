"""Chat rendering and loss-mask spans, derived from the chat template itself.

A *renderer* (``render(messages, add_generation_prompt) -> (text, generation_spans)``) is
supplied by the tokenizer (:mod:`dflash_prep.tokenize.encoders`): for a Hugging Face tokenizer it
is transformers' own Jinja rendering with the tokenizer's special-token variables, so the
text is exactly ``apply_chat_template(messages, tokenize=False)``; ``generation_spans``
are the character ranges of the template's ``{% generation %}`` blocks (empty without
them). :func:`plan_rows` turns one conversation into the rows to tokenize, each a
``Row(text, spans)`` where ``spans`` are the trained character ranges of ``text``.

Where a turn's characters come from, never by searching for content:

- ``P_i = render(messages[:i], add_generation_prompt=True)`` (what the model sees before
  it writes turn ``i``; for a role other than assistant, ``messages[:i]`` plus an empty
  message of that role) and ``F_i = render(messages[:i + 1])``. Turn ``i`` occupies
  ``[lcp(P_i, F_i), len(F_i))`` of ``F_i`` (``lcp``: longest common prefix), and of the
  full rendering ``R`` when ``R`` starts with ``F_i`` (the turn is *stable*).
- With ``{% generation %}`` blocks and ``--roles-to-train assistant``, a turn's trained
  spans are the blocks that end inside its region (a block may begin in the header); with default options on a stable conversation
  they are all blocks, i.e. exactly transformers' ``return_assistant_tokens_mask``.
- Otherwise (no blocks, or other roles) the turn's span is its whole region, less any
  whitespace after its last control token (ChatML's ``<|im_end|>\\n`` trains the
  ``<|im_end|>``, not the newline).
- End of turn: the trailing control tokens of a turn's span (with the whitespace between
  them). ``--train-on-eos turn`` trains them on every trained turn, ``last`` on the row's
  last trained turn only, ``none`` never.
- ``--train-turns last`` trains only the last turn whose role is in ``--roles-to-train``.

Templates that rewrite earlier turns (Qwen3 and DeepSeek-R1 drop the reasoning of
assistant turns before the last user message) make some turns unstable (with default
options and generation blocks, the first trained turn is the one checked; see
:func:`plan_rows`). Then
``--expand-turns auto`` (default) emits one row per trained turn ``i``, the text ``F_i``
(the conversation as the template renders it when turn ``i`` is the latest), trained on
turn ``i`` only; ``never`` keeps the single row ``R`` and trains its last trained turn,
which must be stable. Stable conversations are never expanded.

Control tokens in content (:func:`mark`): every string in a message that spells a control
token (an added token flagged special, e.g. ``<|im_end|>`` or ``</s>``; non-special added
tokens such as Qwen3's ``<think>`` are vocabulary and stay as they are) is wrapped, before
rendering, in the private-use markers of transformers'
``apply_chat_template(sanitize_control_tokens=True)``; the tokenizer then encodes each
marked token as plain text, while the template's own control tokens stay special. Rows of
such conversations carry the markers in ``text`` and their spans are in those marked
coordinates.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

from dflash_prep.errors import ConfigError

MARK_START, MARK_END = "\U000f0000", "\U000f0001"  # transformers' sanitize_control_tokens markers
TRAIN_ON_EOS = ("turn", "last", "none")
TRAIN_TURNS = ("all", "last")
EXPAND_TURNS = ("auto", "never")

Renderer = Callable[[list, bool], tuple[str, list[tuple[int, int]]]]


@dataclass(frozen=True)
class MaskOptions:
    """What the loss mask covers.

    Attributes:
        roles: roles whose turns are trained (``--roles-to-train``, default assistant).
        train_on_eos: ``turn`` | ``last`` | ``none`` (end-of-turn tokens, see module doc).
        train_turns: ``all`` trained roles' turns, or only the ``last`` one.
        expand_turns: ``auto`` (one row per turn when the template rewrites earlier turns) or ``never``.
    """

    roles: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"
    train_turns: str = "all"
    expand_turns: str = "auto"

    def __post_init__(self):
        if not self.roles or any(not isinstance(r, str) or not r for r in self.roles):
            raise ConfigError(f"--roles-to-train needs at least one role name, got {self.roles!r}")
        for name, value, allowed in (("--train-on-eos", self.train_on_eos, TRAIN_ON_EOS),
                                     ("--train-turns", self.train_turns, TRAIN_TURNS),
                                     ("--expand-turns", self.expand_turns, EXPAND_TURNS)):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")

    def to_dict(self) -> dict:
        return {"roles_to_train": list(self.roles), "train_on_eos": self.train_on_eos,
                "train_turns": self.train_turns, "expand_turns": self.expand_turns}


@dataclass(frozen=True)
class Row:
    """One sample to tokenize: the rendered ``text`` and its trained ``[start, end)`` character spans."""

    text: str
    spans: tuple[tuple[int, int], ...]
    marked: bool = False


# ----------------------------------------------------------------------------- control tokens
def control_pattern(tokens: Sequence[str]) -> re.Pattern | None:
    """A regex matching any of ``tokens``, longest first; None when there are none."""
    toks = sorted({t for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, toks))) if toks else None


def mark(messages: list[dict], pattern: re.Pattern | None) -> tuple[list[dict], bool]:
    """Wrap control tokens spelled inside message strings in markers; ``(messages, changed)``.

    Strings are found recursively (e.g. inside ``tool_calls``; dict keys are left alone).
    Markers already in the content are dropped first, so content cannot forge a marked
    token. Returns the input unchanged (and ``False``) when nothing spells a control token.
    """
    if pattern is None:
        return messages, False
    hit = False

    def walk(v):
        nonlocal hit
        if isinstance(v, str):
            if MARK_START in v or MARK_END in v:
                v = v.replace(MARK_START, "").replace(MARK_END, "")
                hit = True
            if pattern.search(v):
                hit = True
                return pattern.sub(lambda x: MARK_START + x.group(0) + MARK_END, v)
            return v
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    out = [walk(m) for m in messages]
    return (out, True) if hit else (messages, False)


# ----------------------------------------------------------------------------- spans
def _lcp(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search on ``str.startswith``, C speed)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _eos_start(text: str, start: int, end: int, control: re.Pattern | None) -> int:
    """Where the trailing control tokens (and whitespace between them) of ``text[start:end]`` begin."""
    pos = end
    if control is None:
        return pos
    while pos > start:
        j = pos
        while j > start and text[j - 1].isspace():
            j -= 1
        hit = None
        for m in control.finditer(text, max(start, j - 64), j):  # control tokens are short
            if m.end() == j and (hit is None or m.start() < hit):
                hit = m.start()
        if hit is None:
            break
        pos = hit
    return pos


def _strip_tail(text: str, start: int, end: int, control: re.Pattern | None) -> int:
    """Drop whitespace after the span's last control token (the template's separator, not the turn)."""
    j = end
    while j > start and text[j - 1].isspace():
        j -= 1
    if j < end and control is not None:
        for m in control.finditer(text, max(start, j - 64), j):
            if m.end() == j:
                return j
    return end


def _prompt(messages: list[dict], i: int, render: Renderer) -> str:
    """What precedes turn ``i``'s own text: the generation prompt for an assistant turn; for
    another role the rendering with an empty message of that role appended (its common
    prefix with ``F_i`` ends where the content starts), else the rendering of ``messages[:i]``."""
    role = messages[i]["role"]
    if role == "assistant":  # the first turn too: the generation prompt of the empty conversation is its header
        try:
            return render(messages[:i], True)[0]
        except ValueError:
            if i:
                raise
            return ""  # a template that refuses to render no messages at all: nothing precedes turn 0
    try:
        return render(messages[:i] + [{"role": role, "content": ""}], False)[0]
    except ValueError:  # the template refuses an empty message
        return render(messages[:i], False)[0] if i else ""


def messages_roles(messages: list[dict], opts: MaskOptions) -> list[int]:
    """Indices of the messages whose role is trained (before ``--train-turns``)."""
    return [i for i, m in enumerate(messages) if m["role"] in opts.roles]


@dataclass
class _Turn:
    index: int
    region: tuple[int, int]  # [lcp(P_i, F_i), len(F_i))
    full: str                # F_i
    stable: bool


def plan_rows(messages: list[dict], render: Renderer, opts: MaskOptions, *, has_generation: bool,
              control: re.Pattern | None, marked: bool = False, stable_template: bool = False) -> tuple[list[Row], bool]:
    """Rows for one validated conversation and whether it was expanded (see the module doc).

    ``stable_template``: the renderer is known never to rewrite earlier turns (the built-in
    ChatML), so no prefix is rendered. With generation blocks and default options the mask
    is the blocks of the whole rendering whatever the check says, and the rewrite check
    renders only the first trained turn's prefix ``F_first`` (history-rewriting templates
    change every turn before the last user message, so the first one shows it): two renders
    per conversation. Otherwise every ``F_i`` and ``P_i`` is rendered (spans cut per turn).
    """
    full, gen_all = render(messages, False)
    all_trained = messages_roles(messages, opts)
    if not all_trained:
        raise ValueError(f"no message has a role in --roles-to-train ({', '.join(opts.roles)}), so nothing to train on")
    trained = all_trained[-1:] if opts.train_turns == "last" else all_trained
    use_blocks = has_generation and opts.roles == ("assistant",)
    default = use_blocks and opts.train_on_eos == "turn" and opts.train_turns == "all"
    if default and stable_template:
        return [Row(full, tuple(gen_all), marked)], False
    if default and len(trained) > 1:  # cheap rewrite check first: the first trained turn's prefix
        first = render(messages[: trained[0] + 1], False)
        if full.startswith(first[0]):
            return [Row(full, tuple(gen_all), marked)], False
    rendered = [(full, gen_all) if i == len(messages) - 1 else render(messages[: i + 1], False) for i in trained]
    fulls = [f for f, _ in rendered]
    stable = [full.startswith(f) for f in fulls]
    if default and all(stable):
        return [Row(full, tuple(gen_all), marked)], False
    turns = [_Turn(i, (_lcp(_prompt(messages, i, render), f), len(f)), f, st)
             for i, f, st in zip(trained, fulls, stable)]

    def spans_of(turn: _Turn, text: str, blocks: list, last: bool) -> list[tuple[int, int]]:
        lo, hi = turn.region
        if use_blocks:
            out = [(a, b) for a, b in blocks if lo < b <= hi and b > a]  # blocks ending in the turn
        else:
            out = [(lo, _strip_tail(text, lo, hi, control))] if hi > lo else []
        if out and (opts.train_on_eos == "none" or (opts.train_on_eos == "last" and not last)):
            a, b = out[-1]
            out[-1] = (a, _eos_start(text, a, b, control))
        return [(a, b) for a, b in out if b > a]

    keep = None
    if all(stable):
        keep = turns
    elif opts.expand_turns == "never":
        if not turns[-1].stable:
            raise ValueError("the chat template renders the last trained turn differently inside the whole "
                             "conversation; use --expand-turns auto")
        keep = turns[-1:]  # never: one row, trained on its last turn
    if keep is not None:
        spans: list[tuple[int, int]] = []
        for k, t in enumerate(keep):
            spans += spans_of(t, full, gen_all, k == len(keep) - 1)
        return [Row(full, tuple(sorted(spans)), marked)], False
    rows = []
    for t, (_, blocks) in zip(turns, rendered):
        rows.append(Row(t.full, tuple(spans_of(t, t.full, list(blocks) if use_blocks else [], True)), marked))
    return rows, True


def chatml_render(messages: list, add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
    """The built-in ChatML layout (:data:`CHATML_TEMPLATE` rendered natively, no Jinja needed)."""
    parts, spans, pos = [], [], 0
    for m in messages:
        head = "<|im_start|>" + m["role"] + "\n"
        body = m["content"] + "<|im_end|>"
        parts += [head, body, "\n"]
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        pos += len(head) + len(body) + 1
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts), spans


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""``--chat-template chatml``: ChatML with ``{% generation %}`` around each answer and its ``<|im_end|>``."""


def read_template_arg(value: str) -> str:
    """``--chat-template FILE|chatml`` -> the template source."""
    if value == "chatml":
        return CHATML_TEMPLATE
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ConfigError(f"--chat-template {value}: no such file; pass a Jinja template file or 'chatml'")
    with open(path, encoding="utf-8") as f:
        return f.read()

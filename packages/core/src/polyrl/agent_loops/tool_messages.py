"""The tokens ``tool_agent`` appends after a model turn: the chat template's text around the tool messages,
with the messages' own text (tool output, tool names, call ids: data) unable to become control tokens.

The model's turns are kept exactly as sampled; only what follows a turn is tokenized here, as the text the
chat template puts after an assistant message's content when tool messages follow it, up to and including
the next generation prompt. That text comes from rendering a fixed stub conversation (a user message and an
assistant message whose content is a marker) plus the tool messages, and taking what follows the marker:

* what the template does to *earlier* turns does not matter (Qwen3 renders the last assistant turn with
  a ``<think>`` block and strips it from earlier ones; other templates trim or re-format the last assistant
  turn): the earlier turns stay as they were sampled, which is also what those templates give for turns
  after the last user message when the model wrote them in the template's own format;
* the tool messages carry ``name`` (the tool called: a configured tool's name, or ``error``) and
  ``tool_call_id`` (the model's id when it wrote nine alphanumerics, else ``call`` + five digits, as
  Mistral's template requires), so templates that need them render; neither can hold text the model chose
  freely.

Tool output is data. Each message's content is rendered once with a sentinel in its place, which locates the
content's text in the rendering (whether the template inserts it raw, as Qwen's does, or JSON-encoded, as
Llama 3.1's does); the whole text is tokenized as the tokenizer would (so the result is token for token what
tokenizing it whole gives, as long as the data holds no control string), and any special or added token that
falls inside a field's text is undone: the stretch of text between the template's own control tokens around
it is tokenized again without added tokens, so ``<|im_end|>`` written by a tool is the characters
``<|im_end|>``, never the token.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from polyrl.errors import ConfigError

logger = logging.getLogger("polyrl")

__all__ = ["ChatTemplateError", "ToolTurnRenderer", "encode_with_data"]

_STUB_USER = "polyrl-stub-user"
_STUB_ASSISTANT = "polyrl-stub-assistant"
#: The message fields that hold data (text a tool or the model wrote). ``name`` and ``tool_call_id`` do not:
#: the loop only puts tool names and well-formed ids there (and templates validate them: Mistral's wants
#: nine alphanumerics, so a sentinel could not stand in for an id).
_DATA_FIELDS = ("content",)


class ChatTemplateError(ConfigError):
    """The tokenizer's chat template cannot render what ``tool_agent`` appends."""


class ToolTurnRenderer:
    """Token ids of what follows a model turn that called tools (see the module docstring)."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._checked = False
        self._warned = False

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                                  **self.template_kwargs)
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def check(self) -> None:
        """Fail once, clearly, when the chat template cannot render tool messages after an assistant turn."""
        if self._checked:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError("tool_agent needs a tokenizer with a chat template (tokenizer.chat_template is "
                                    "empty); set one in tokenizer_config.json")
        probe = "polyrl-probe-tool-output"
        try:
            tail = self._tail([_tool_message(probe, "probe_tool", "call00000")])
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja raises for roles a template does not know
            raise ChatTemplateError(f"the tokenizer's chat template cannot render a 'tool' message after an "
                                    f"assistant message: {type(exc).__name__}: {exc}. Use a template with a tool "
                                    "role (docs/agents.md)") from exc
        if probe not in tail:
            raise ChatTemplateError("the tokenizer's chat template drops 'tool' messages (no tool role); use a "
                                    "template that renders {'role': 'tool'} (docs/agents.md)")
        self._checked = True

    def _tail(self, messages: list[dict]) -> str:
        """The rendering's text after the stub assistant message's content."""
        stub = [{"role": "user", "content": _STUB_USER}, {"role": "assistant", "content": _STUB_ASSISTANT}]
        text = self._render(stub + messages, generation_prompt=True)
        at = text.rfind(_STUB_ASSISTANT)
        if at < 0:
            raise ChatTemplateError("the chat template does not render an assistant message's content, so the "
                                    "text after a model turn cannot be found (docs/agents.md)")
        return text[at + len(_STUB_ASSISTANT):]

    def delta_ids(self, messages: Sequence[dict], sampled_end: Sequence[str] = ()) -> list[int]:
        """The token ids after a model turn for tool ``messages``, up to the next generation prompt, less the
        end-of-turn text the model already sampled (``sampled_end``: the text of the stop token that ended
        the turn first, then the other stop tokens' texts)."""
        pieces = self.delta_pieces(messages)
        first = pieces[0][0] if pieces and not pieces[0][1] else ""
        for end in sampled_end:
            if end and first.startswith(end):
                pieces[0] = (first[len(end):], False)
                break
        return encode_with_data(self.tokenizer, pieces)

    def delta_pieces(self, messages: Sequence[dict]) -> list[tuple[str, bool]]:
        """The text after a model turn as ``(text, is_data)`` pieces: the template's own text, and the text
        it made of each data field of ``messages`` (see the module docstring)."""
        messages = [dict(m) for m in messages]
        sentinels: dict[str, tuple[int, str]] = {}
        masked = []
        for i, m in enumerate(messages):
            m2 = dict(m)
            for f in _DATA_FIELDS:
                if isinstance(m.get(f), str):
                    s = f"polyrlsentinel{i}x{_DATA_FIELDS.index(f)}z"
                    sentinels[s] = (i, f)
                    m2[f] = s
            masked.append(m2)
        real = self._tail(messages)
        sent = self._tail(masked)
        if not sentinels:
            return [(real, False)]
        pattern = re.compile("|".join(re.escape(s) for s in sentinels))
        parts = pattern.split(sent)  # template text between sentinel occurrences
        order = pattern.findall(sent)
        raw: dict[str, str] = {s: messages[i][f] for s, (i, f) in sentinels.items()}
        rendered: dict[str, str] | None = raw
        if _assemble(parts, order, raw) != real:
            rendered = self._rendered_fields(messages, masked, sentinels, sent, order)
            if rendered is None or _assemble(parts, order, rendered) != real:
                if not self._warned:
                    self._warned = True
                    logger.warning("tool_agent: the chat template renders tool messages in a way polyrl cannot "
                                   "line up with their text; tool output is inserted as written (still as data, "
                                   "never as control tokens)")
                rendered = raw
        assert rendered is not None
        pieces: list[tuple[str, bool]] = [(parts[0], False)]
        for s, after in zip(order, parts[1:]):
            pieces += [(rendered[s], True), (after, False)]
        return [p for p in pieces if p[0]]

    def _rendered_fields(self, messages: list[dict], masked: list[dict], sentinels: dict[str, tuple[int, str]],
                         sent: str, order: list[str]) -> dict[str, str] | None:
        """How the template renders each field (JSON-encoded, escaped...): one rendering per field, with only
        that field real."""
        out: dict[str, str] = {}
        for s, (i, f) in sentinels.items():
            k = order.count(s)
            if k == 0:
                continue
            trial = [dict(m) for m in masked]
            trial[i][f] = messages[i][f]
            text = self._tail(trial)
            grown = len(text) - len(sent)
            if grown % k:
                return None
            first = sent.index(s)
            value = text[first:first + len(s) + grown // k]
            if sent.replace(s, value) != text:
                return None
            out[s] = value
        return out


def _assemble(parts: list[str], order: list[str], values: dict[str, str]) -> str:
    out = [parts[0]]
    for s, after in zip(order, parts[1:]):
        out += [values[s], after]
    return "".join(out)


def _tool_message(content: str, name: str, call_id: str) -> dict[str, str]:
    return {"role": "tool", "content": content, "name": name, "tool_call_id": call_id}


# ---------------------------------------------------------------------- tokenizing with data spans

def control_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special and added tokens (``<|im_end|>``, ``<tool_call>``, ``[INST]``...)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    return {int(i) for i in ids}


def encode_with_data(tokenizer: Any, pieces: Sequence[tuple[str, bool]]) -> list[int]:
    """Token ids of the concatenated ``(text, is_data)`` pieces, where no special or added token comes
    from the data pieces' text (they are data: the characters of a control string, never the token)."""
    text = "".join(p for p, _ in pieces)
    if not text:
        return []
    spans, pos = [], 0
    for piece, is_data in pieces:
        if is_data and piece:
            spans.append((pos, pos + len(piece)))
        pos += len(piece)
    control = control_ids(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: template pieces as usual, data with special tokens split
        ids: list[int] = []
        for piece, is_data in pieces:
            if piece:
                ids += _plain(tokenizer, piece, control) if is_data else tokenizer.encode(piece, add_special_tokens=False)
        return ids
    enc = backend.encode(text, add_special_tokens=False)
    ids, offsets = list(enc.ids), list(enc.offsets)

    def in_data(start: int, end: int) -> bool:
        return any(start < b and a < max(end, start + 1) for a, b in spans)

    injected = [k for k, t in enumerate(ids) if t in control and in_data(*offsets[k])]
    if not injected:
        return ids
    # the template's own control tokens cut the text; a stretch between two of them that holds an injected
    # one is tokenized again, as text without added tokens
    cuts = [k for k, t in enumerate(ids) if t in control and not in_data(*offsets[k])]
    out: list[int] = []
    prev_k, prev_end = -1, 0
    for k in [*cuts, len(ids)]:
        start_char = prev_end
        end_char = offsets[k][0] if k < len(ids) else len(text)
        stretch = range(prev_k + 1, k)
        if any(j in injected for j in stretch):
            out += _plain(tokenizer, text[start_char:end_char], control)
        else:
            out += ids[prev_k + 1:k]
        if k < len(ids):
            out.append(ids[k])
            prev_k, prev_end = k, offsets[k][1]
    return out


#: ``id(backend) -> (backend, its copy without added tokens)`` (the backend is kept, so its id stays its own).
_PLAIN_CACHE: dict[int, tuple[Any, Any]] = {}


def _plain(tokenizer: Any, text: str, control: set[int]) -> list[int]:
    """``text`` tokenized with no special or added token recognised (and, as a last resort, none produced)."""
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        cached = _PLAIN_CACHE.get(id(backend))
        if cached is None or cached[0] is not backend:
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            cached = _PLAIN_CACHE[id(backend)] = (backend, Tokenizer.from_str(json.dumps(spec)))
        clone = cached[1]
        ids = list(clone.encode(text, add_special_tokens=False).ids)
    else:
        ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if not control.intersection(ids):
        return ids
    # a vocabulary whose model can still produce a control id from text (SentencePiece control pieces):
    # one character at a time
    out: list[int] = []
    for ch in text:
        piece = list(clone.encode(ch, add_special_tokens=False).ids) if backend is not None else list(
            tokenizer.encode(ch, add_special_tokens=False, split_special_tokens=True))
        out += [t for t in piece if t not in control]
    return out

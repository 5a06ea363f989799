"""Tool calls read from one choice's text as it grows: `feed` takes the cumulative text and
returns what is new, as OpenAI streams it (content pieces; for call i a header with its id,
type and name, then pieces of its arguments). A non-streamed answer goes through the same
parser (the whole text fed once, then `finish`), so both agree by construction.

What is a call, per style:
- hermes (`auto`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the
  text; text outside the tags streams as content as it comes, only a suffix that could begin
  `<tool_call>` (and trailing whitespace, which is dropped next to a call) is held back.
- llama3 (`auto`): the answer starts with a JSON call `{"name": ..., "parameters" or
  "arguments": {...}}` (or calls follow `<|python_tag|>`); calls are separated by `;`. From
  the first object that is no call of a known function on, the text is content.
- mistral (`auto`): `[TOOL_CALLS]` then a JSON array of calls `[{"name": ..., "arguments":
  {...}}, ...]` anywhere in the text; text outside streams as content, as with hermes.
- array (`required`): the grammar's `[{"name": ..., "arguments": {...}}, ...]`.
- named (a named function): the whole text is the arguments object.

Rules:
- A call is known once its name string closes, and its header (id, type, name, arguments
  "") goes out then, alone. A name not among the tools (or no name, or an object that breaks
  before the name) makes the held-back text plain content again; an object that breaks
  after a known name ends the call there.
- The arguments are the model's own text, a raw substring of it: the pieces concatenate to
  exactly the arguments value and end where it closes (a scanner that knows strings, escapes
  and nesting finds that point). They are not validated (outside `required` and a named
  function, which are grammar-constrained, the model may write invalid JSON; OpenAI says the
  same of its own). A call without arguments gets `{}` when its object closes.
- Whitespace next to a call is dropped; content on both sides of a call keeps the space
  that came before it.
- A call cut short (max_tokens, abort) stays a call with the arguments written so far, and
  the finish_reason stays `length` / `abort` (`stop` if a stop string cut it); `tool_calls`
  is the finish_reason only for an answer that stopped by itself (SGLang's rule); OpenAI
  clients then get the partial arguments, as OpenAI sends them. Held-back text that never
  became a call (an unclosed `<tool_call>{"na`) is sent as content at the end.
- `one_call` (parallel_tool_calls false): calls after the first are parsed but dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from minisgl.protocol.openai_tool_scan import WS, CallScanner, json_string_value

HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
ARRAYS = ("array", "mistral")  # the styles whose calls form a JSON array


@dataclass
class ToolDelta:
    """What one feed added: content and OpenAI's delta.tool_calls (one entry per call)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def header(self, index: int, call_id: str, name: str) -> None:
        self.tool_calls.append({"index": index, "id": call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}})

    def arguments(self, index: int, piece: str) -> None:
        entry = next((c for c in self.tool_calls if c["index"] == index), None)
        if entry is None:
            entry = {"index": index, "function": {"arguments": ""}}
            self.tool_calls.append(entry)
        entry["function"]["arguments"] += piece

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        for call in other.tool_calls:
            if "id" in call:
                self.header(call["index"], call["id"], call["function"]["name"])
            self.arguments(call["index"], call["function"]["arguments"])
        return self


@dataclass
class _Call:
    scan: CallScanner
    index: int | None = None  # its place in tool_calls; None: not known yet, or dropped
    confirmed: bool = False
    sent: int = 0  # the arguments' text sent so far ends here


class ContentStream:
    """A parser's content side: what of `text` went out as content (up to `sent`), with the
    whitespace rules next to a call (module docstring)."""

    text: str
    sent: int
    content: str
    strip_lead: bool  # drop the whitespace after a call
    gap: str  # the whitespace before the last call
    calls: list[dict[str, Any]]  # OpenAI's message.tool_calls, as sent

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished text; content None when empty and calls."""
        self.feed(text)
        self.finish()
        return (None if self.calls and not self.content else self.content), self.calls

    def _content(self, out: ToolDelta, upto: int) -> None:
        gap = ""
        if self.strip_lead:
            start = self.sent
            while self.sent < upto and self.text[self.sent] in WS:
                self.sent += 1
            # NOTE: content on both sides of a call keeps one gap (the space before the call)
            gap = (self.gap or self.text[start:self.sent]) if self.content else ""
        if self.sent < upto:
            piece = gap + self.text[self.sent:upto]
            out.content += piece
            self.content += piece
            self.strip_lead = False
        self.sent = max(self.sent, upto)

    def _safe_end(self, tag: str | None, pos: int) -> int:
        """Where content may go out to in a text with no call markup past `pos`: the end, but
        for a suffix that could begin `tag` and trailing whitespace (dropped if a call
        follows)."""
        text, safe = self.text, len(self.text)
        if tag:
            for k in range(min(len(tag) - 1, len(text) - pos), 0, -1):
                if text.endswith(tag[:k]):
                    safe -= k
                    break
        while safe > self.sent and text[safe - 1] in WS:
            safe -= 1
        return safe


class WholeCallParser(ContentStream):
    """Calls that go out whole once their text closes (a pythonic list, a Gemma 4 block):
    each call's header alone, its arguments with the next feed (or the finish). A subclass
    moves through the text with `_step`, which `_emit`s the calls of a closed candidate."""

    def __init__(self, names: set[str], one_call: bool = False) -> None:
        self.names, self.one_call = names, one_call
        self.text = ""
        self.pos = self.sent = 0  # scanned up to / content sent up to
        self.candidate: int | None = None  # where an open candidate begins
        self.strip_lead = False  # drop the whitespace that follows a call
        self.gap = ""  # the whitespace before the last call
        self.pending: list[tuple[int, str]] = []  # arguments to send with the next feed
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> ToolDelta:
        self.text, out = text, ToolDelta()
        self._flush(out)
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        self._flush(out)
        while self._step(out, final=True):
            pass
        self._flush(out)
        self._content(out, len(self.text))
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _step(self, out: ToolDelta, final: bool) -> bool:
        """One move; False when it waits for more text (or, final, is done)."""
        raise NotImplementedError

    def _open(self, out: ToolDelta, found: int, tag: str, final: bool) -> bool:
        """With no candidate open: with none `found` (-1), send the content that cannot begin
        `tag` (all of it when final) and answer False; else open the one at `found` (the
        content before it goes out, the whitespace just before it kept as the gap)."""
        text = self.text
        if found < 0:
            safe = len(text) if final else self._safe_end(tag, self.pos)
            self._content(out, safe)
            self.pos = max(self.pos, safe)
            return False
        self.candidate = end = found
        while end > self.sent and text[end - 1] in WS:
            end -= 1
        self._content(out, end)
        self.gap = text[end:found]
        return True

    def _emit(self, out: ToolDelta, calls: list[tuple[str, str]], end: int, final: bool
              ) -> bool:
        """The calls (name, JSON arguments) of the candidate that ends at `end` (one_call:
        the first of the answer alone); `_step`'s answer after them."""
        if self.one_call:
            calls = [] if self.calls else calls[:1]
        for name, arguments in calls:
            index = len(self.calls)
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            self.calls.append({"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": arguments}})
            out.header(index, call_id, name)
            self.pending.append((index, arguments))
        self.pos = self.sent = end
        self.candidate, self.strip_lead = None, True
        return final  # a call's header goes out alone: its arguments with the next feed

    def _not_calls(self) -> None:
        """The candidate's first character is content; scanning goes on past it."""
        self.pos, self.candidate = self.candidate + 1, None

    def _flush(self, out: ToolDelta) -> None:
        for index, arguments in self.pending:
            out.arguments(index, arguments)
        self.pending.clear()


class ToolCallParser(ContentStream):
    """The calls in one choice's text (see the module's docstring)."""

    def __init__(self, style: str, names: set[str], one_call: bool = False,
                 named: str | None = None) -> None:
        self.style, self.names, self.one_call, self.named = style, names, one_call, named
        self.tag = {"hermes": HERMES_OPEN, "llama3": PYTHON_TAG, "mistral": MISTRAL_TAG}.get(style)
        self.state = "named" if named else ("text" if style in ("hermes", "mistral") else "lead")
        self.text = ""
        self.pos = self.sent = 0  # read up to / content sent up to
        self.start = 0  # where the candidate call being read began (its markup)
        self.strip_lead = False  # drop whitespace after a call
        self.gap = ""  # the whitespace before the last call
        self.call: _Call | None = None
        self.content = ""
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls, as sent
        self.cut = False  # a call's object never closed

    # ---- the public side ---------------------------------------------------------------

    def feed(self, text: str) -> ToolDelta:
        """What `text` (the choice's cumulative text) adds to what was returned before; a
        call's header goes out alone (arguments ""), what follows it waits for the next feed
        (or the finish)."""
        self.text, out = text, ToolDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ToolDelta:
        """The rest, once the text is final: what was held back, cut calls as they are."""
        out = ToolDelta()
        while self._step(out, final=True):
            pass
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for an answer that called and stopped by itself, with every call's
        object closed (SGLang's rule); else the request's own reason."""
        return "tool_calls" if self.calls and reason == "stop" and not self.cut else reason

    # ---- output --------------------------------------------------------------------------

    def _header(self, out: ToolDelta, call: _Call, name: str) -> bool:
        """Sends call's header unless the call is dropped; True if it was sent."""
        call.confirmed = True
        if self.one_call and self.calls:
            return False  # parallel_tool_calls false: only the first call counts
        call.index = len(self.calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
        out.header(call.index, call_id, name)
        return True

    def _arguments(self, out: ToolDelta, call: _Call, piece: str) -> None:
        if call.index is not None and piece:
            self.calls[call.index]["function"]["arguments"] += piece
            out.arguments(call.index, piece)

    # ---- the states ------------------------------------------------------------------------

    def _skip_space(self) -> bool:
        """Past whitespace at pos; False if the text ends there."""
        while self.pos < len(self.text) and self.text[self.pos] in WS:
            self.pos += 1
        return self.pos < len(self.text)

    def _step(self, out: ToolDelta, final: bool) -> bool:
        """One move of the state machine; False when it waits for more text (or is done)."""
        text, state = self.text, self.state
        if state == "named":
            if self.call is None:
                self.call = _Call(CallScanner(0))
                self._header(out, self.call, self.named or "")
                if not final:
                    return False  # NOTE: the header goes alone, as OpenAI sends it
            self._arguments(out, self.call, text[self.call.sent:])
            self.call.sent = len(text)
            return False
        if state == "text":
            return self._free_text(out, final)
        if state == "lead":  # llama3 / array: does the answer begin with a call?
            if not self._skip_space():
                if final:
                    self.state = "text"
                    return True
                return False
            opener = "[" if self.style == "array" else "{"
            self.start = self.pos
            if text[self.pos] != opener:
                self.state = "text"
            elif self.style == "array":
                self.pos += 1
                self.state = "between"
            else:
                self._begin_call()
            return True
        if state == "open":  # after hermes' <tool_call>, llama3's <|python_tag|>, [TOOL_CALLS]
            if not self._skip_space():
                if final:
                    self._not_a_call()
                    return True
                return False
            if self.style == "mistral" and text[self.pos] == "[":
                self.pos += 1
                self.state = "between"
            elif self.style != "mistral" and text[self.pos] == "{":
                self._begin_call()
            else:
                self._not_a_call()
            return True
        if state == "between":  # an array after [ or ",", llama3 after ";"
            if not self._skip_space():
                if final:
                    self._drop_rest()
                return False
            if text[self.pos] == "{":
                self._begin_call()
            elif self.style in ARRAYS and text[self.pos] == "]":
                self.pos += 1
                self._after_markup()
            else:
                self._not_a_call()
            return True
        if state == "call":
            return self._in_call(out, final)
        if state == "after":
            return self._after_call(final)
        raise AssertionError(state)

    def _free_text(self, out: ToolDelta, final: bool) -> bool:
        text = self.text
        found = text.find(self.tag, self.pos) if self.tag else -1
        if found < 0:
            safe = self._safe_end(self.tag, self.pos) if not final and self.tag else len(text)
            self._content(out, safe)
            self.pos = max(self.pos, safe)
            return False
        end = found
        while end > self.sent and text[end - 1] in WS:
            end -= 1
        self._content(out, end)
        self.gap = text[end:found]
        self.start, self.pos, self.state = found, found + len(self.tag), "open"
        return True

    def _begin_call(self) -> None:
        self.call = _Call(CallScanner(self.pos))
        self.state = "call"

    def _not_a_call(self) -> None:
        """The candidate since `start` is no call: its text is content (searched for the
        next tag past its start)."""
        tagged = self.tag is not None and self.text.startswith(self.tag, self.start)
        self.state, self.call = "text", None
        self.pos = self.start + (len(self.tag) if tagged else 1)

    def _drop_rest(self) -> None:
        """At the end: what is left (markup, separators, whitespace) is no content."""
        self.state, self.pos = "text", len(self.text)
        self.sent = self.pos

    def _in_call(self, out: ToolDelta, final: bool) -> bool:
        text, call = self.text, self.call
        scan = call.scan
        scan.scan(text)
        if not call.confirmed:
            name = scan.span("name")
            if name is not None and name[1] is not None:
                value = json_string_value(text[name[0]:name[1]])
                if value not in self.names:
                    self._not_a_call()
                    return True
                if self._header(out, call, value) and not final:
                    return False  # the header goes alone (arguments ""); the rest next feed
            elif scan.broken or scan.end is not None or final:
                self._not_a_call()
                return True
            else:
                return False
        args = scan.arguments_span()
        if args is not None:
            start, end = args
            if call.sent < start:
                call.sent = start
            upto = end if end is not None else (
                scan.pos if text[start] in '{["' or final else call.sent)
            self._arguments(out, call, text[call.sent:upto])
            call.sent = max(call.sent, upto)
        if scan.end is None and not scan.broken:
            if final:
                self.cut = self.cut or call.index is not None
                self._drop_rest()
            return False
        if args is None and scan.end is not None:
            self._arguments(out, call, "{}")
        self.pos = self.sent = scan.end if scan.end is not None else scan.pos
        self.state, self.call = "after", None
        return True

    def _after_call(self, final: bool) -> bool:
        text = self.text
        if not self._skip_space():
            if final:
                self._drop_rest()
            return False
        rest = text[self.pos:]
        if self.style == "hermes":
            if rest.startswith(HERMES_CLOSE):
                self.pos += len(HERMES_CLOSE)
                self._after_markup()
                return True
            if HERMES_CLOSE.startswith(rest):  # the tag may still be coming
                if final:
                    self._drop_rest()
                return False
            self._after_markup()
            return True
        separator = "," if self.style in ARRAYS else ";"
        if rest[0] == separator:
            self.pos += 1
            self.state, self.start = "between", self.pos - 1
        elif self.style in ARRAYS and rest[0] == "]":
            self.pos += 1
            self._after_markup()
        else:
            self._after_markup()
        return True

    def _after_markup(self) -> None:
        """A call's markup ended at pos: what follows is content, its leading space dropped."""
        self.state, self.sent, self.strip_lead = "text", self.pos, True

"""`--tool-call-parser gemma4`: Gemma 4's tool calls, each a block
`<|tool_call>call:NAME{key:VALUE,...}<tool_call|>` anywhere in the text (its markers are
special tokens: a request with tools keeps them in the text, `skip_special_tokens` false).
A value is a string between `<|"|>` quotes (taken as written, no escapes), a number, true,
false, null, a list `[VALUE,...]` or an object `{key:VALUE,...}` whose keys are bare (or
quoted); the arguments go out as the JSON object they spell. The same interface as
openai_tool_parser's ToolCallParser (feed / finish / parse / finish_reason).

A block is a call once it closes and reads as one of a known function; until then its text is
held back; one that is not (an unknown name, a broken value) is content, as is one that never
closes. Each call's header goes out alone, its arguments with the next feed (or the finish).
Whitespace next to a call is dropped; content on both sides keeps the space that came before
it. `one_call` (parallel_tool_calls false) keeps the first call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from minisgl.protocol.openai_tool_parser import ToolDelta, WholeCallParser
from minisgl.protocol.openai_tool_scan import WS

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL_HEAD = re.compile(r"\s*call:([A-Za-z_][\w.\-]*)\s*")
NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
LITERALS = {"true": True, "false": False, "null": None}
KEY_END = re.compile(r"\s*:")


class Unreadable(ValueError):
    pass


class ValueReader:
    """Gemma 4's argument syntax to Python values, from a position in a text."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in WS:
            self.pos += 1

    def value(self) -> Any:
        self.skip()
        text, pos = self.text, self.pos
        if text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            if end < 0:
                raise Unreadable("an unclosed string")
            self.pos = end + len(QUOTE)
            return text[pos + len(QUOTE):end]
        if text.startswith('"', pos):  # a JSON string
            try:
                value, self.pos = json.JSONDecoder().raw_decode(text, pos)
            except ValueError as exc:
                raise Unreadable("a broken string") from exc
            return value
        if text.startswith("{", pos):
            return self.container("}", self.pair, dict)
        if text.startswith("[", pos):
            return self.container("]", self.value, list)
        for word, value in LITERALS.items():
            if text.startswith(word, pos):
                self.pos = pos + len(word)
                return value
        number = NUMBER.match(text, pos)
        if number is None:
            raise Unreadable(f"no value at {text[pos:pos + 20]!r}")
        self.pos = number.end()
        return json.loads(number.group())

    def container(self, close: str, item: Any, kind: type) -> Any:
        self.pos += 1
        items = []
        self.skip()
        if self.text.startswith(close, self.pos):
            self.pos += 1
            return kind(items)
        while True:
            items.append(item())
            self.skip()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif self.text.startswith(close, self.pos):
                self.pos += 1
                return kind(items)
            else:
                raise Unreadable(f"expected , or {close}")

    def pair(self) -> tuple[str, Any]:
        self.skip()
        if self.text.startswith((QUOTE, '"'), self.pos):
            key = self.value()
            if not isinstance(key, str):
                raise Unreadable("a key that is not a string")
        else:
            end = self.text.find(":", self.pos)
            key = self.text[self.pos:end].strip() if end >= 0 else ""
            if not key or any(c in key for c in "{}[],"):
                raise Unreadable("a broken key")
            self.pos = end
        colon = KEY_END.match(self.text, self.pos)
        if colon is None:
            raise Unreadable("a key without a value")
        self.pos = colon.end()
        return key, self.value()


def read_call(body: str, names: set[str]) -> tuple[str, str] | None:
    """(name, JSON arguments) of a block's body `call:NAME{...}` of a known function, or
    None."""
    head = CALL_HEAD.match(body)
    if head is None or head.group(1) not in names:
        return None
    reader = ValueReader(body)
    reader.pos = head.end()
    try:
        if not body.startswith("{", reader.pos):
            raise Unreadable("no arguments object")
        arguments = reader.value()
        reader.skip()
    except (Unreadable, RecursionError):
        return None
    if reader.pos != len(body):
        return None
    return head.group(1), json.dumps(arguments, ensure_ascii=False)


def block_end(text: str, start: int) -> int | None:
    """Where the block whose body starts at `start` closes (the index of its close marker,
    strings skipped), None while it is open."""
    pos = start
    while True:
        close, quote = text.find(CALL_CLOSE, pos), text.find(QUOTE, pos)
        if close < 0 and quote < 0:
            return None
        if quote < 0 or (0 <= close < quote):
            return close
        end = text.find(QUOTE, quote + len(QUOTE))
        if end < 0:
            return None
        pos = end + len(QUOTE)


class Gemma4CallParser(WholeCallParser):
    def _step(self, out: ToolDelta, final: bool) -> bool:
        """One move; False when it waits for more text (or, final, is done)."""
        text = self.text
        if self.candidate is None and not self._open(out, text.find(CALL_OPEN, self.pos),
                                                     CALL_OPEN, final):
            return False
        body = self.candidate + len(CALL_OPEN)
        close = block_end(text, body)
        if close is None and not final:
            return False
        call = None if close is None else read_call(text[body:close], self.names)
        if call is None:  # not a call, or a block that never closed: content
            self._not_calls()
            return True
        return self._emit(out, [call], close + len(CALL_CLOSE), final)

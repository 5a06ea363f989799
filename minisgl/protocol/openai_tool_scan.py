"""The JSON scanner under the tool-call parser (openai_tool_parser): it follows one call
object as its text grows and says where each top-level value begins and ends, so that a
call's arguments can be sent as raw pieces of the model's own text that end exactly where
the arguments value closes."""

from __future__ import annotations

import json
from typing import Any

WS = " \t\r\n"
ARGUMENT_KEYS = ("arguments", "parameters")


def json_string_value(raw: str) -> str | None:
    """A JSON string's value; None if `raw` is not one (a bad escape, another kind)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class CallScanner:
    """One call object `{"key": value, ...}` from its `{`, a character at a time: where each
    top-level value starts and ends (only the first of each key), and where the object
    closes. Strings, escapes and nesting are followed; nothing else is validated."""

    def __init__(self, start: int) -> None:
        self.pos = start  # next character to read
        self.depth = 0
        self.in_string = self.escaped = False
        self.expect = "open"  # open, key, in_key, colon, value, in_value, scalar, comma
        self.key_start = 0
        self.key: Any = None
        self.spans: dict[Any, list[int | None]] = {}  # key -> [start, end or None]
        self.end: int | None = None  # after the closing brace
        self.broken = False  # not an object of key/value pairs

    def scan(self, text: str) -> None:
        while self.pos < len(text) and self.end is None:
            self._char(text, self.pos)
            if self.broken:
                return  # NOTE: pos stays at the character that broke it
            self.pos += 1

    def _close_value(self, end: int) -> None:
        self.spans[self.key][1] = end
        self.expect = "comma"

    def _char(self, text: str, i: int) -> None:
        c = text[i]
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.expect == "in_key":
                    self.key = json_string_value(text[self.key_start:i + 1])
                    self.broken = self.key is None
                    self.expect = "colon"
                elif self.depth == 1:  # a string value at the top level
                    self._close_value(i + 1)
            return
        if self.depth > 1:  # inside a container value
            if c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._close_value(i + 1)
            return
        if self.expect == "scalar":
            if c not in WS + ",}":
                return
            self._close_value(i)
        if c in WS and self.expect != "open":
            return
        if self.expect == "open":
            self.broken = c != "{"
            self.depth, self.expect = 1, "key"
        elif self.expect == "key" and c == '"':
            self.in_string, self.key_start, self.expect = True, i, "in_key"
        elif self.expect in ("key", "comma") and c == "}":
            self.depth, self.end = 0, i + 1
        elif self.expect == "colon" and c == ":":
            if self.key in self.spans:  # a repeated key: its value is scanned, not kept
                self.key = ("repeated", i)
            self.spans[self.key], self.expect = [None, None], "value"
        elif self.expect == "value" and c not in ",}]:":
            self.spans[self.key][0] = i
            if c == '"':
                self.in_string, self.expect = True, "in_value"
            elif c in "{[":
                self.depth, self.expect = 2, "in_value"
            else:
                self.expect = "scalar"
        elif self.expect == "comma" and c == ",":
            self.expect = "key"
        else:
            self.broken = True

    def span(self, key: str) -> list[int | None] | None:
        span = self.spans.get(key)
        return span if span is not None and span[0] is not None else None

    def arguments_span(self) -> list[int | None] | None:
        found = [s for s in (self.span(k) for k in ARGUMENT_KEYS) if s is not None]
        return min(found, key=lambda s: s[0]) if found else None

"""`--tool-call-parser pythonic`: tool calls written as a Python list of calls,
`[get_weather(city="Paris", days=3), get_time(zone="UTC")]` (Llama 3.2 / 4 and the models SGLang's
function-calling tests prompt this way), anywhere in the text, optionally between Llama 4's
`<|python_start|>` and `<|python_end|>`. The same interface as openai_tool_parser's
ToolCallParser (feed / finish / parse / finish_reason).

A list is a call list only once it closes and reads as one: every element a call of a known
function, with keyword arguments whose values are Python literals (converted to JSON:
True -> true, None -> null, tuples -> arrays). Until then its text is held back; a list that
is not one (`[1]`, a markdown link, an unknown function) is content, as is one that never
closes. Each call's header goes out alone, its JSON arguments with the next feed (or the
finish). Whitespace next to a list is dropped; content on both sides keeps the space that
came before it. `one_call` (parallel_tool_calls false) keeps the first call.
"""

from __future__ import annotations

import ast
import json

from minisgl.protocol.openai_tool_parser import ToolDelta, WholeCallParser
from minisgl.protocol.openai_tool_scan import WS

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
CLOSING = {"[": "]", "(": ")", "{": "}"}


def list_end(text: str, start: int) -> int | None:
    """Past the `]` that closes the list opened at text[start]; None while it is open, -1 if
    it breaks (a bracket closed by the wrong one). Knows Python's quoted strings."""
    stack: list[str] = []
    quote, i = "", start
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in CLOSING:
            stack.append(CLOSING[char])
        elif char in ")]}":
            if char != stack.pop():
                return -1
            if not stack:
                return i + 1
        i += 1
    return None


def read_calls(source: str, names: set[str]) -> list[tuple[str, str]] | None:
    """[(name, JSON arguments)] of a Python list of calls of known functions, or None."""
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for call in tree.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in names and not call.args
                and all(k.arg is not None for k in call.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append((call.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return calls


class PythonicCallParser(WholeCallParser):
    def _step(self, out: ToolDelta, final: bool) -> bool:
        """One move; False when it waits for more text (or, final, is done)."""
        text = self.text
        if self.candidate is None:
            found = [i for i in (text.find("[", self.pos), text.find(PYTHON_START, self.pos))
                     if i >= 0]
            if not self._open(out, min(found, default=-1), PYTHON_START, final):
                return False
        start = self.candidate
        opening = start + len(PYTHON_START) if text.startswith(PYTHON_START, start) else start
        while opening < len(text) and text[opening] in WS:
            opening += 1
        if opening >= len(text):
            return self._undecided(final)
        end = list_end(text, opening) if text[opening] == "[" else -1
        if end is None:
            return self._undecided(final)
        calls = read_calls(text[opening:end], self.names) if end > 0 else None
        if calls is None:
            self._not_calls()
            return True
        if text.startswith(PYTHON_START, start):
            after = end
            while after < len(text) and text[after] in WS:
                after += 1
            if PYTHON_END.startswith(text[after:]) and not final:
                return False  # its end tag may still be coming
            if text.startswith(PYTHON_END, after):
                end = after + len(PYTHON_END)
        return self._emit(out, calls, end, final)

    def _undecided(self, final: bool) -> bool:
        if final:  # a list that never closed: content
            self._not_calls()
            return True
        return False

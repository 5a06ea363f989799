"""OpenAI's harmony format (gpt-oss; `--reasoning-parser gpt-oss`, `--tool-call-parser gpt-oss`):
a chat answer is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|start|>assistant<|channel|>final<|message|>...

and the turn ends with `<|return|>` or, after a call, `<|call|>` (stop tokens, so not in the
text). The markers are special tokens: a harmony request's text is decoded with them kept.

What each message becomes:
- a recipient `to=functions.NAME` (before or after the channel) of a function among the
  request's tools: a tool call, its body the arguments (the model's raw text, streamed as it
  comes); a recipient that is no such function: the body is content, so nothing is lost;
- the `analysis` channel: reasoning_content (content with `separate_reasoning: false`);
- any other channel (`final`, a `commentary` preamble): content.
Text before any header is content. A marker that may be arriving at the end of the text is held
back until it is known, so where the text is cut never changes the result; a header cut short
(max_tokens) is dropped. `stream_reasoning: false` holds the reasoning until it ends.
`parallel_tool_calls: false` keeps only the first call. A continued assistant message
(continue_final_message) is read first, as the answer's start: the answer goes on in the
message it left open (a call left open is the answer's, with the arguments written so far).

Constrained output (tool_choice required or a named function, strict tools, response_format)
is xgrammar's structural tag for harmony: free analysis, then the calls or the answer in their
form.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.flag_checks import HARMONY_PARSER
from minisgl.grammar import builtin_structural_tag
from minisgl.protocol.fields import check_bool, none_as
from minisgl.protocol.openai_tool_parser import ToolDelta
from minisgl.protocol.openai_tools import ToolUse
from minisgl.protocol.reasoning import Reasoning, held_prefix

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TURN_ENDS = (RETURN, CALL)  # stop strings of a harmony request (also stop tokens in gpt-oss)
_BODY_ENDS = (END, CALL, RETURN, START, CHANNEL)
_HEADER_STARTS = (START, CHANNEL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]*)")
FUNCTIONS = "functions."
EFFORTS = ("low", "medium", "high")  # reasoning_effort values gpt-oss's template knows
FINAL_HEADER, ANALYSIS_HEADER = CHANNEL + "final" + MESSAGE, CHANNEL + "analysis" + MESSAGE
ASSISTANT_START = START + "assistant"  # what separates an answer's messages
MARKER_OPEN = "<|"  # every marker's start, kept out of a constrained analysis


@dataclass
class HarmonyDelta(ToolDelta):
    """What one feed added: reasoning, content and tool calls."""

    reasoning: str = ""

    def __iadd__(self, other: ToolDelta) -> HarmonyDelta:
        super().__iadd__(other)
        self.reasoning += getattr(other, "reasoning", "")
        return self


class HarmonyParser:
    """One choice's harmony text as it streams: feed the cumulative text, get what is new."""

    def __init__(self, names: set[str], one_call: bool = False, separate_reasoning: bool = True,
                 stream_reasoning: bool = True, prefix: str = "") -> None:
        self.names, self.one_call = names, one_call
        self.separate, self.stream_reasoning = separate_reasoning, stream_reasoning
        self.prefix, self.text, self.pos = prefix, "", 0
        self.body: str | None = None  # the open message's body kind; None: in a header
        self.call_index: int | None = None  # the open call's place in `calls` (None: dropped)
        self.held_reasoning = ""
        self.reasoning, self.content = "", ""
        self.calls: list[dict[str, Any]] = []  # OpenAI's message.tool_calls, as sent
        self.open_call: dict[str, Any] | None = None  # a call the prefix left open, unsent
        if prefix:
            self.feed("")
            self.reasoning = self.content = self.held_reasoning = ""
            if self.body == "call" and self.call_index is not None:
                self.open_call, self.calls = self.calls[self.call_index], [
                    self.calls[self.call_index]]
                self.call_index = 0
            else:
                self.calls, self.call_index = [], None

    def feed(self, text: str) -> HarmonyDelta:
        """What the answer's cumulative `text` adds."""
        self.text, out = self.prefix + text, HarmonyDelta()
        if self.open_call is not None:
            call, self.open_call = self.open_call, None
            out.header(0, call["id"], call["function"]["name"])
            out.arguments(0, call["function"]["arguments"])
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> HarmonyDelta:
        out = HarmonyDelta()
        while self._step(out, final=True):
            pass
        self._release_reasoning(out)
        for call in self.calls:  # a call whose body never came
            if not call["function"]["arguments"]:
                call["function"]["arguments"] = "{}"
                out.arguments(self.calls.index(call), "{}")
        return out

    def parse(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning or None, content or None when empty beside calls or reasoning, calls)."""
        self.feed(text)
        self.finish()
        content = self.content or (None if self.calls or self.reasoning else "")
        return self.reasoning or None, content, self.calls

    def finish_reason(self, reason: str | None) -> str | None:
        """`tool_calls` for an answer that called and stopped by itself."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    # ---- reading ---------------------------------------------------------------------------

    def _step(self, out: HarmonyDelta, final: bool) -> bool:
        """Reads what it can from `pos`; True while there may be more to read now."""
        text = self.text
        if self.pos >= len(text):
            return False
        if self.body is None:
            rest = text[self.pos:]
            if not rest.startswith(_HEADER_STARTS):
                if not final and any(m.startswith(rest) for m in _HEADER_STARTS):
                    return False  # NOTE: may still become a header
                self.body = "content"  # text before any header
                return True
            at = text.find(MESSAGE, self.pos)
            if at < 0:
                if final:
                    self.pos = len(text)  # a header cut short
                return False
            self._open(out, text[self.pos:at])
            self.pos = at + len(MESSAGE)
            return True
        ends = [(text.find(m, self.pos), m) for m in _BODY_ENDS]
        found = [(at, m) for at, m in ends if at >= 0]
        if found:
            at, marker = min(found)
            self._emit(out, text[self.pos:at])
            self.pos = at + len(marker) if marker not in _HEADER_STARTS else at
            self._close(out)
            return True
        upto = len(text) if final else len(text) - held_prefix(text, self.pos, list(_BODY_ENDS))
        self._emit(out, text[self.pos:upto])
        self.pos = upto
        return False

    def _open(self, out: HarmonyDelta, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        self.body = ("reasoning" if channel and channel.group(1) == "analysis"
                     and self.separate else "content")
        if recipient is None:
            return
        name = recipient.group(1)
        if not name.startswith(FUNCTIONS) or name[len(FUNCTIONS):] not in self.names:
            self.body = "content"
            return
        self._release_reasoning(out)
        self.body, self.call_index = "call", None
        if self.one_call and self.calls:
            return  # parallel_tool_calls false: only the first call counts
        self.call_index = len(self.calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": name[len(FUNCTIONS):], "arguments": ""}})
        out.header(self.call_index, call_id, name[len(FUNCTIONS):])

    def _emit(self, out: HarmonyDelta, piece: str) -> None:
        if not piece:
            return
        if self.body == "reasoning":
            self.reasoning += piece
            if self.stream_reasoning:
                out.reasoning += piece
            else:
                self.held_reasoning += piece
        elif self.body == "call":
            if self.call_index is not None:
                self.calls[self.call_index]["function"]["arguments"] += piece
                out.arguments(self.call_index, piece)
        else:
            self._release_reasoning(out)
            self.content += piece
            out.content += piece

    def _close(self, out: HarmonyDelta) -> None:
        if self.body == "reasoning":
            self._release_reasoning(out)
        self.body = None

    def _release_reasoning(self, out: HarmonyDelta) -> None:
        out.reasoning += self.held_reasoning
        self.held_reasoning = ""


# ---- requests --------------------------------------------------------------------------------

def reasoning_effort(value: Any) -> str | None:
    """The request's reasoning_effort (chat) or reasoning.effort (responses), checked."""
    if value is None:
        return None
    if value not in EFFORTS:
        raise InvalidRequest(f"reasoning_effort must be one of {', '.join(EFFORTS)}, "
                             f"got {value!r}")
    return value


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An earlier answer's reasoning, as clients send it back (`reasoning_content`, vLLM's
    `reasoning`), where harmony templates read it (`thinking`)."""
    out = []
    for m in messages:
        thought = m.get("reasoning_content") or m.get("reasoning")
        if m["role"] == "assistant" and thought and not m.get("thinking"):
            m = {**m, "thinking": thought}
        out.append(m)
    return out


def harmony_reasoning(body: dict[str, Any]) -> Reasoning | None:
    """How a harmony answer's analysis is returned: None with `separate_reasoning: false`
    (it joins the content)."""
    separate = check_bool(none_as(body.get("separate_reasoning"), True), "separate_reasoning")
    stream = check_bool(none_as(body.get("stream_reasoning"), True), "stream_reasoning")
    return Reasoning(HARMONY_PARSER, False, stream) if separate else None


def harmony_params(params: SamplingParams) -> None:
    """A harmony request's text keeps the markers (special tokens) the parser reads, and
    stops at the end of the turn where the vocabulary does not make it a stop token."""
    params.skip_special_tokens = params.spaces_between_special_tokens = False
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    params.stop = stops + [m for m in TURN_ENDS if m not in stops]


def _content_format(kind: str, text: str) -> dict[str, Any]:
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(text)}
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": text}
    raise InvalidRequest(f"a {kind} answer format is not supported with the harmony format "
                         "(ask for a JSON schema, a regex or an EBNF grammar)")


def harmony_grammar(tools: ToolUse | None, answer: tuple[str, str] | None
                    ) -> tuple[str, str] | None:
    """(kind, text) of the grammar a harmony answer follows, built from xgrammar's harmony
    forms: `answer` (None) where there is no answer format and no strict tool under
    tool_choice auto; strict tools under `auto`: messages of any kind, each call in its
    function's form. Otherwise an optional analysis (ended by `<|end|>`), then the final
    answer following `answer` (or, under `auto`, calls instead), or, under `required` or a
    named function, one call or more (one without parallel calls)."""
    if answer is None and (tools is None or (tools.choice == "auto" and not tools.strict)):
        return answer
    if answer is not None and tools is not None and tools.choice != "auto":
        raise InvalidRequest("tool_choice required or a named function constrains the "
                             "answer already: drop response_format / regex / ebnf")
    functions = [] if tools is None else [
        t for t in tools.tools if tools.choice in ("auto", "required")
        or t["function"]["name"] == tools.choice]
    free = builtin_structural_tag("harmony", tools=functions, tool_choice="auto")["format"]
    if answer is None and tools is not None and tools.choice == "auto":
        return "structural_tag", json.dumps({"type": "structural_tag", "format": free})
    analysis = next(t for t in free["tags"] if t["begin"] == ANALYSIS_HEADER)
    analysis = {**analysis, "end": END,
                "content": {**analysis["content"], "excludes": [MARKER_OPEN]}}
    calls = {**free, "tags": [t for t in free["tags"] if t["end"] == CALL],
             "at_least_one": True, "stop_after_first": tools is not None and not tools.parallel}
    last = calls
    if answer is not None:
        final = {**next(t for t in free["tags"] if t["begin"] == FINAL_HEADER),
                 "content": _content_format(*answer)}
        last = {"type": "or", "elements": [final, calls]} if functions else final
    form = {"type": "or", "elements": [
        {"type": "sequence", "elements": [
            analysis, {"type": "const_string", "value": ASSISTANT_START}, last]},
        last]}
    return "structural_tag", json.dumps({"type": "structural_tag", "format": form})

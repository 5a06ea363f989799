"""Reasoning output (`--reasoning-parser`, SGLang's names `qwen3`, `deepseek-r1` and
`gemma4`): a chat answer's thinking, written between `<think>` and `</think>` (Gemma 4's:
`<|channel>thought` and a newline, then `<channel|>`, special tokens its requests keep in the
text), is returned as `reasoning_content` apart from `content`.

Where the answer starts (SGLang's rules, parser/reasoning_parser.py and
entrypoints/openai/serving_chat.py):
- deepseek-r1: always inside the reasoning (its template opens `<think>` for the model).
- qwen3: inside when the chat template's generation prompt (after the request's system
  message) leaves a `<think>` open; outside when it holds a closed block (Qwen3's
  `enable_thinking: false`, SmolLM3's `/no_think`); otherwise inside unless
  `chat_template_kwargs.enable_thinking` is false (a template without a thinking switch), or
  the template has a switch that is off by default and the request does not turn it on.
- gemma4: as qwen3 where the generation prompt says; otherwise outside (the model opens its
  thought channel itself, which the leading-marker rule below reads).
- A continued final assistant message (continue_final_message) moves it: its last marker
  wins, `<think>` opens the reasoning, `</think>` closes it.
Inside, the reasoning runs to the first `</think>` (for qwen3 also to a `<tool_call>`, which
stays in the content: Qwen3 may call a tool without closing its thinking); an answer cut short
is all reasoning. `<think>` (repeated or not) is dropped where the output starts with it and is
plain text anywhere else. `separate_reasoning: false` leaves the text whole in `content`;
`stream_reasoning: false` sends the reasoning in one piece once it has ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import check_bool, none_as

THINK_START, THINK_END = "<think>", "</think>"
# --reasoning-parser -> a text that also ends the reasoning (it stays in the content)
REASONING_PARSERS: dict[str, str | None] = {"qwen3": "<tool_call>", "deepseek-r1": None,
                                            "gemma4": None}
# --reasoning-parser -> its thinking's (start, end) markers where they are not <think>'s
MARKERS = {"gemma4": ("<|channel>thought\n", "<channel|>")}
# the parsers whose markers are special tokens: their requests' text keeps them
SPECIAL_TOKEN_PARSERS = ("gemma4",)


def markers(parser: str | None) -> tuple[str, str]:
    """The (start, end) markers of `parser`'s thinking."""
    return MARKERS.get(parser or "", (THINK_START, THINK_END))
THINKING_SWITCH = "enable_thinking"  # the chat template variable Qwen3's templates read


@dataclass
class ReasoningDelta:
    """What one feed added: reasoning and content text."""

    reasoning: str = ""
    content: str = ""


def held_prefix(text: str, start: int, markers: list[str]) -> int:
    """How many characters at the end of text[start:] may begin one of `markers`."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


class ReasoningParser:
    """One choice's text split as it streams: feed the cumulative text, get what is new on each
    side. Where the text is cut never changes the result (a marker that may be arriving is held
    back until it is known)."""

    def __init__(self, in_reasoning: bool, interrupt: str | None = None,
                 stream_reasoning: bool = True,
                 marks: tuple[str, str] = (THINK_START, THINK_END)) -> None:
        self.forced, self.interrupt = in_reasoning, interrupt
        self.start, self.end = marks
        self.stream_reasoning = stream_reasoning
        self.text, self.pos = "", 0
        self.phase = "lead"  # lead (a leading <think> may still come), reasoning, content
        self.opened = False  # the output started with <think>
        self.held = ""  # reasoning not sent yet (stream_reasoning false)
        self.reasoning = ""  # every reasoning character read so far
        self.content = ""  # every content character read so far

    def feed(self, text: str) -> ReasoningDelta:
        self.text, out = text, ReasoningDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        """The rest, once the text is final: held-back text, unsent reasoning."""
        out = ReasoningDelta()
        self._advance(out, final=True)
        out.reasoning += self.held
        self.held = ""
        return out

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there is none, content) of a finished text."""
        self.feed(text)
        self.finish()
        return self.reasoning or None, self.content

    def _advance(self, out: ReasoningDelta, final: bool) -> None:
        text = self.text
        if self.phase == "lead":
            while text.startswith(self.start, self.pos):
                self.pos += len(self.start)
                self.opened = True
            rest = text[self.pos:]
            if not final and (not rest or self.start.startswith(rest)):
                return  # NOTE: may still become a leading <think>
            self.phase = "reasoning" if self.forced or self.opened else "content"
        if self.phase == "reasoning":
            ends = [m for m in (self.end, self.interrupt) if m]
            found = [(text.find(m, self.pos), m) for m in ends if text.find(m, self.pos) >= 0]
            if not found:
                upto = len(text) if final else len(text) - held_prefix(text, self.pos, ends)
                self._reason(out, text[self.pos:upto])
                self.pos = upto
                return
            at, marker = min(found)
            self._reason(out, text[self.pos:at])
            out.reasoning += self.held
            self.held = ""
            self.pos = at + len(marker) if marker == self.end else at
            self.phase = "content"
        out.content += text[self.pos:]
        self.content += text[self.pos:]
        self.pos = len(text)

    def _reason(self, out: ReasoningDelta, piece: str) -> None:
        self.reasoning += piece
        if self.stream_reasoning:
            out.reasoning += piece
        else:
            self.held += piece


# ---- where a request's answer starts ---------------------------------------------------------

def _think_state(text: str, marks: tuple[str, str] = (THINK_START, THINK_END)) -> str:
    """"open" if `text` leaves a <think> (marks' start) open, "closed" if its last marker is
    </think> (marks' end), ""."""
    start, end = text.rfind(marks[0]), text.rfind(marks[1])
    if start > end:
        return "open"
    return "closed" if end >= 0 else ""


@dataclass
class TemplateThinking:
    """What the chat template's generation prompt holds of the thinking, with enable_thinking
    absent, true and false ("open", "closed" or "", see _think_state)."""

    default: str = ""
    on: str = ""
    off: str = ""
    switch_off_by_default: bool = False

    @classmethod
    def probe(cls, chat_prompt: Callable[[list[dict[str, Any]], dict[str, Any]], str],
              system: str | None = None, marks: tuple[str, str] = (THINK_START, THINK_END)
              ) -> TemplateThinking:
        """Render one user turn (after the system message `system`, where a template may
        read a switch: SmolLM3's `/think` and `/no_think`) with and without the generation
        prompt, for each value of the switch; a template that cannot render it tells
        nothing."""
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": "Hi"}]

        def generation_prompt(extra: dict[str, Any]) -> str:
            with_prompt = chat_prompt(messages, {**extra, "add_generation_prompt": True})
            without = chat_prompt(messages, {**extra, "add_generation_prompt": False})
            return with_prompt[len(without):] if with_prompt.startswith(without) else with_prompt

        try:
            prompts = [generation_prompt(extra) for extra in
                       ({}, {THINKING_SWITCH: True}, {THINKING_SWITCH: False})]
        except Exception:
            return cls()
        default, on, off = prompts
        return cls(_think_state(default, marks), _think_state(on, marks),
                   _think_state(off, marks),
                   switch_off_by_default=on != off and default == off)


@dataclass
class Reasoning:
    """How a chat request's answer is split (None on the request: it is not)."""

    parser: str  # --reasoning-parser
    in_reasoning: bool  # the answer starts inside the reasoning
    stream: bool = True  # stream_reasoning

    def new_parser(self) -> ReasoningParser:
        return ReasoningParser(self.in_reasoning, REASONING_PARSERS[self.parser], self.stream,
                               markers(self.parser))


def starts_in_reasoning(parser: str, template: TemplateThinking,
                        template_kwargs: dict[str, Any], prefix: str) -> bool:
    """Whether the answer (after `prefix`, a continued assistant message) starts inside the
    reasoning; see the module's docstring."""
    inside, marks = parser != "gemma4", markers(parser)
    if parser in ("qwen3", "gemma4"):
        switch = template_kwargs.get(THINKING_SWITCH)
        state = ("" if template_kwargs.get("add_generation_prompt") is False
                 else template.default if THINKING_SWITCH not in template_kwargs
                 else template.on if switch else template.off)
        if state:
            inside = state == "open"
        elif parser == "gemma4":
            inside = False
        elif THINKING_SWITCH not in template_kwargs:
            inside = not template.switch_off_by_default
        else:
            inside = switch is not False
    continued = _think_state(prefix, marks)
    return continued == "open" if continued else inside


def request_reasoning(body: dict[str, Any], parser: str | None, template: TemplateThinking,
                      template_kwargs: dict[str, Any], prefix: str
                      ) -> tuple[Reasoning | None, bool]:
    """(how the answer is split, or None when it is not; whether generation starts inside the
    reasoning, so a grammar applies only after `</think>`)."""
    separate = check_bool(none_as(body.get("separate_reasoning"), True), "separate_reasoning")
    stream = check_bool(none_as(body.get("stream_reasoning"), True), "stream_reasoning")
    if parser is None:
        return None, False
    switch = template_kwargs.get(THINKING_SWITCH)
    if switch is not None and not isinstance(switch, bool):
        raise InvalidRequest(f"chat_template_kwargs.{THINKING_SWITCH} must be true or false, "
                             f"got {switch!r}")
    inside = starts_in_reasoning(parser, template, template_kwargs, prefix)
    return (Reasoning(parser, inside, stream) if separate else None), inside

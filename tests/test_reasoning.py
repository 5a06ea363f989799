"""Reasoning output (--reasoning-parser): the streaming parser on hand-written texts cut
at every place, where an answer starts (SGLang's rules) on real Jinja templates, the matcher
that holds a grammar back until `</think>` (a multi-token marker here), then the real `openai`
SDK against a real server.

SmolLM2 does not think by itself. The server's chat template is a small Qwen3-like one (it
reads `enable_thinking`), and the conversation shows two answers that think inside
`<think>...</think>` first: greedy decoding then writes the same form for the question asked,
so the parser splits real model output, whose `</think>` comes in several tokens."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jsonschema
import openai
import pytest
import requests

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.grammar.matcher import ReasonerMatcher
from minisgl.protocol.reasoning import (ReasoningParser, TemplateThinking, markers,
                                        starts_in_reasoning)
from tests.conftest import start_minisgl_server
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

# ---- the parser, no server ----------------------------------------------------------------------


def split(text: str, cuts: list[int], **kw: Any) -> tuple[str | None, str, list[str]]:
    """Feed text cut at `cuts` (cumulative), then finish: (reasoning, content, the reasoning
    pieces as they came)."""
    parser, content, pieces = ReasoningParser(**kw), "", []
    deltas = [parser.feed(text[:cut]) for cut in [*cuts, len(text)]]
    for delta in [*deltas, parser.finish()]:
        content += delta.content
        if delta.reasoning:
            pieces.append(delta.reasoning)
    return "".join(pieces) or None, content, pieces


def check(text: str, reasoning: str | None, content: str, **kw: Any) -> None:
    """Whole, and cut at every pair of places: the same split, the one expected."""
    assert ReasoningParser(**kw).parse(text) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split(text, [i, j], **kw)[:2] == (reasoning, content), (i, j)


QWEN3 = {"interrupt": "<tool_call>"}


def test_parser_splits_alike_at_every_cut():
    check("<think>\nI add.\n</think>\n\n4", "\nI add.\n", "\n\n4", in_reasoning=True, **QWEN3)
    check("<think>\nI add.\n</think>4", "\nI add.\n", "4", in_reasoning=False)
    check("I add.</think>4", "I add.", "4", in_reasoning=True)  # deepseek-r1: no <think>
    check("<think><think>a</think>b", "a", "b", in_reasoning=True)
    check("I add.</think>4", None, "I add.</think>4", in_reasoning=False)  # not reasoning
    check("So <think>x</think>y", None, "So <think>x</think>y", in_reasoning=False)
    check("Still thinking</thi", "Still thinking</thi", "", in_reasoning=True)  # cut short
    check("<thin", None, "<thin", in_reasoning=False)
    check("", None, "", in_reasoning=True)
    # Qwen3 may call a tool without closing its thinking: the call is content
    check("Call it.<tool_call>{}</tool_call>", "Call it.", "<tool_call>{}</tool_call>",
          in_reasoning=True, **QWEN3)
    check("Call it.<tool_call>{}", "Call it.<tool_call>{}", "", in_reasoning=True)  # r1


def test_stream_reasoning_false_sends_the_reasoning_once_it_ended():
    text = "<think>a b c</think>done"
    for i in range(len(text) + 1):
        assert split(text, [i], in_reasoning=True, stream_reasoning=False) == (
            "a b c", "done", ["a b c"])
    assert split("a b c", [1, 3], in_reasoning=True, stream_reasoning=False)[2] == ["a b c"]
    assert split(text, [9, 10], in_reasoning=True)[2] == ["a ", "b", " c"]  # streamed


# ---- where the answer starts -------------------------------------------------------------------

CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
          "+ '<|im_end|>\\n' }}{%- endfor %}")
# Qwen3's switch: thinking by default, `enable_thinking: false` closes an empty block
SWITCH_TEMPLATE = CHATML + (
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
OPENS_TEMPLATE = CHATML + ("{%- if add_generation_prompt %}"
                           "{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
PLAIN_TEMPLATE = CHATML + ("{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                           "{%- endif %}")
OFF_BY_DEFAULT_TEMPLATE = CHATML + (
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking | default(false) %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")


# a switch in the system message (SmolLM3's kind): `/no_think` there closes an empty block
SYSTEM_SWITCH_TEMPLATE = (
    "{%- set off = messages[0]['role'] == 'system' and '/no_think' in messages[0]['content'] %}"
    + CHATML + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if off %}{{ '<think>\\n\\n</think>\\n' }}{%- endif %}{%- endif %}")


def thinking(template: str, system: str | None = None) -> TemplateThinking:
    compiled = jinja2.Environment().from_string(template)
    return TemplateThinking.probe(lambda messages, kw: compiled.render(messages=messages, **kw),
                                  system)


@pytest.mark.parametrize("template, kwargs, prefix, inside", [
    (SWITCH_TEMPLATE, {}, "", True),
    (SWITCH_TEMPLATE, {"enable_thinking": True}, "", True),
    (SWITCH_TEMPLATE, {"enable_thinking": False}, "", False),
    (PLAIN_TEMPLATE, {}, "", True),  # no switch: assumed thinking (SGLang's qwen3 default)
    (PLAIN_TEMPLATE, {"enable_thinking": False}, "", False),
    (OPENS_TEMPLATE, {"enable_thinking": False}, "", True),  # the template opens it anyway
    (OFF_BY_DEFAULT_TEMPLATE, {}, "", False),
    (OFF_BY_DEFAULT_TEMPLATE, {"enable_thinking": True}, "", True),
    (SWITCH_TEMPLATE, {"enable_thinking": False}, "<think>\nSo", True),  # a continued message
    (SWITCH_TEMPLATE, {}, "<think>\nSo.</think>\n", False),
    (SWITCH_TEMPLATE, {"add_generation_prompt": False, "enable_thinking": False}, "", False),
])
def test_qwen3_start(template, kwargs, prefix, inside):
    assert starts_in_reasoning("qwen3", thinking(template), kwargs, prefix) is inside


@pytest.mark.parametrize("system, inside", [
    (None, True), ("Answer briefly.", True), ("Answer briefly. /no_think", False)])
def test_qwen3_start_follows_a_switch_in_the_system_message(system, inside):
    template = thinking(SYSTEM_SWITCH_TEMPLATE, system)
    assert starts_in_reasoning("qwen3", template, {}, "") is inside


GEMMA4 = {"marks": markers("gemma4"), "in_reasoning": False}


def test_gemma4_thought_channel_splits_alike_at_every_cut():
    """Gemma 4 opens its thought channel itself: `<|channel>thought` and a newline, the
    thinking, `<channel|>`; without it the answer is content."""
    check("<|channel>thought\nI add.<channel|>4", "I add.", "4", **GEMMA4)
    check("4, as <|channel>thought\nx<channel|>", None, "4, as <|channel>thought\nx<channel|>",
          **GEMMA4)
    check("<|channel>thought\nStill thinking<chan", "Still thinking<chan", "", **GEMMA4)
    check("<|channel>though", None, "<|channel>though", **GEMMA4)
    check("Sure.</think>", None, "Sure.</think>", **GEMMA4)


GEMMA4_TEMPLATE = (
    "{%- for m in messages %}{{ '<|turn>' + m['role'] + '\\n' + m['content'] + '<turn|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|turn>model\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<|channel>thought\\n<channel|>' }}"
    "{%- elif enable_thinking is defined %}{{ '<|channel>thought\\n' }}{%- endif %}{%- endif %}")


@pytest.mark.parametrize("kwargs, prefix, inside", [
    ({}, "", False),  # the model opens the channel when it thinks
    ({"enable_thinking": False}, "", False),  # an empty thought in the prompt
    ({"enable_thinking": True}, "", True),  # a template that opens the channel
    ({}, "<|channel>thought\nSo", True),  # a continued message inside the channel
    ({}, "<|channel>thought\nSo.<channel|>", False),
])
def test_gemma4_start(kwargs, prefix, inside):
    template = jinja2.Environment().from_string(GEMMA4_TEMPLATE)
    probed = TemplateThinking.probe(lambda m, kw: template.render(messages=m, **kw),
                                    marks=markers("gemma4"))
    assert starts_in_reasoning("gemma4", probed, kwargs, prefix) is inside


def test_deepseek_r1_always_starts_inside_unless_continued_past_it():
    for template in (SWITCH_TEMPLATE, PLAIN_TEMPLATE):
        assert starts_in_reasoning("deepseek-r1", thinking(template), {"enable_thinking": False},
                                   "")
    assert not starts_in_reasoning("deepseek-r1", thinking(PLAIN_TEMPLATE), {}, "a</think>")
    assert thinking("{{ raise_exception('no') }}") == TemplateThinking()  # tells nothing


# ---- the grammar after </think> ------------------------------------------------------------------

class RecordingMatcher:
    """A grammar that takes any token and ends after `length` of them."""

    def __init__(self, length: int) -> None:
        self.length, self.taken = length, []

    def accept_token(self, token_id: int) -> bool:
        self.taken.append(token_id)
        return True

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> None:
        bitmask[index] = 7

    def is_terminated(self) -> bool:
        return len(self.taken) >= self.length

    def rollback(self, num_tokens: int = 1) -> None:
        del self.taken[len(self.taken) - num_tokens:]


VOCAB = [b"</", b"think", b">", b"</think>", b"x", b">\n\n", b"<", b"/", b"{"]


@pytest.mark.parametrize("reasoning, after", [
    ([4, 0, 1, 2], [8, 8]),  # </ think >
    ([3], [8, 8]),  # one token
    ([4, 6, 7, 1, 5], [8, 8]),  # < / think >\n\n: the marker ends inside a token
])
def test_reasoner_matcher_passes_tokens_until_the_marker(reasoning, after):
    import torch

    inner = RecordingMatcher(len(after))
    matcher = ReasonerMatcher(inner, b"</think>", VOCAB)
    bitmask = torch.zeros((1, 2), dtype=torch.int32)
    for token in reasoning:
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert bitmask.tolist() == [[-1, -1]] and not matcher.is_terminated()
        assert matcher.accept_token(token)
    assert inner.taken == []
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert bitmask.tolist() == [[7, 7]]
    for token in after:
        matcher.accept_token(token)
    assert inner.taken == after and matcher.is_terminated()
    matcher.rollback(len(after) + 1)  # back into the reasoning, before its last token
    assert inner.taken == [] and not matcher.is_terminated()
    matcher.accept_token(reasoning[-1])
    matcher.accept_token(8)
    assert inner.taken == [8]


def test_no_marker_no_grammar():
    matcher = ReasonerMatcher(RecordingMatcher(1), b"</think>", VOCAB)
    for token in [0, 1, 4, 2, 6, 1, 2]:  # "</thinkx>" and "<think>" end nothing
        matcher.accept_token(token)
    assert matcher.inner.taken == []


def test_grammar_after_is_not_a_request_field():
    with pytest.raises(InvalidRequest, match="grammar_after"):
        SamplingParams.from_dict({"grammar_after": "</think>"})


# ---- a real server ------------------------------------------------------------------------------

SYSTEM = "Think inside <think> </think> tags first, then answer."
SHOTS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nTwo plus two is four.\n</think>\nThe answer is 4."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant",
     "content": "<think>\nFrance's capital is Paris.\n</think>\nThe answer is Paris."},
    {"role": "user", "content": "What color is the sky?"},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_SHOTS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": '<think>\nI should call get_weather for Paris.\n</think>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "<think>\n"},  # continued: the answer starts inside
]
COLOR = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}


@pytest.fixture(scope="module")
def server():
    server = start_minisgl_server("--reasoning-parser", "qwen3",
                                  "--chat-template", SWITCH_TEMPLATE)
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]] = SHOTS, **extra: Any) -> Any:
    tools = extra.pop("tools", openai.NOT_GIVEN)
    response_format = extra.pop("response_format", openai.NOT_GIVEN)
    return client.chat.completions.create(
        model="", messages=messages, temperature=0, max_tokens=60, tools=tools,
        response_format=response_format, extra_body=extra)


def ask_stream(client: openai.OpenAI, messages: list[dict[str, Any]] = SHOTS,
               **extra: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The deltas (as JSON) and the finish_reason of a streamed answer."""
    tools = extra.pop("tools", openai.NOT_GIVEN)
    response_format = extra.pop("response_format", openai.NOT_GIVEN)
    deltas, reason = [], None
    for chunk in client.chat.completions.create(
            model="", messages=messages, temperature=0, max_tokens=60, stream=True,
            tools=tools, response_format=response_format, extra_body=extra):
        deltas.append(chunk.choices[0].delta.model_dump())
        reason = chunk.choices[0].finish_reason or reason
    return deltas, reason


def joined(deltas: list[dict[str, Any]], key: str) -> str:
    return "".join(d[key] or "" for d in deltas)


def test_reasoning_is_split_from_the_model_output(client):
    split_answer = ask(client).choices[0].message
    raw = ask(client, separate_reasoning=False).choices[0].message
    assert raw.reasoning_content is None
    reasoning, content = split_answer.reasoning_content, split_answer.content
    assert reasoning and content and "think>" not in reasoning + content
    # the model opened <think> itself (Qwen3's way): the text as it wrote it
    assert raw.content == f"<think>{reasoning}</think>{content}"


def test_stream_carries_reasoning_content_then_content(client):
    whole = ask(client).choices[0].message
    deltas, reason = ask_stream(client)
    assert all("reasoning_content" in d for d in deltas)  # null where there is none
    assert joined(deltas, "reasoning_content") == whole.reasoning_content
    assert joined(deltas, "content") == whole.content
    reasoning_at = [k for k, d in enumerate(deltas) if d["reasoning_content"]]
    content_at = [k for k, d in enumerate(deltas) if d["content"]]
    assert len(reasoning_at) > 1 and reasoning_at[-1] < content_at[0] and reason == "stop"
    # stream_reasoning false: the reasoning in one piece, once it has ended
    deltas, _ = ask_stream(client, stream_reasoning=False)
    assert [d["reasoning_content"] for d in deltas if d["reasoning_content"]] == [
        whole.reasoning_content]
    assert joined(deltas, "content") == whole.content


def test_enable_thinking_false_answers_in_content(client):
    off = ask(client, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    raw = ask(client, chat_template_kwargs={"enable_thinking": False},
              separate_reasoning=False).choices[0].message
    assert off.reasoning_content is None and off.content == raw.content and off.content
    deltas, _ = ask_stream(client, chat_template_kwargs={"enable_thinking": False})
    assert joined(deltas, "reasoning_content") == "" and joined(deltas, "content") == off.content


def test_continued_message_decides_where_the_answer_starts(client):
    opened = ask(client, SHOTS + [{"role": "assistant", "content": "<think>\n"}],
                 continue_final_message=True).choices[0].message
    raw = ask(client, SHOTS + [{"role": "assistant", "content": "<think>\n"}],
              continue_final_message=True, separate_reasoning=False).choices[0].message
    assert opened.reasoning_content and raw.content == (
        f"{opened.reasoning_content}</think>{opened.content}")
    closed = ask(client, SHOTS + [{"role": "assistant", "content": "<think>\nEasy.\n</think>\n"}],
                 continue_final_message=True).choices[0].message
    assert closed.reasoning_content is None and closed.content


def test_tool_calls_are_read_from_the_content_after_the_reasoning(client):
    message = ask(client, TOOL_SHOTS, tools=[WEATHER], continue_final_message=True,
                  max_tokens=80)
    choice = message.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content and "get_weather" in choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    deltas, reason = ask_stream(client, TOOL_SHOTS, tools=[WEATHER],
                                continue_final_message=True, max_tokens=80)
    assert reason == "tool_calls"
    assert joined(deltas, "reasoning_content") == choice.message.reasoning_content
    arguments = "".join(c["function"]["arguments"] or "" for d in deltas
                        for c in d["tool_calls"] or [])
    assert json.loads(arguments) == {"city": "Rome"}


def test_grammar_applies_after_the_reasoning(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR}}
    message = ask(client, response_format=fmt).choices[0].message
    assert message.reasoning_content and not message.reasoning_content.lstrip().startswith("{")
    jsonschema.validate(json.loads(message.content), COLOR)
    raw = ask(client, response_format=fmt, separate_reasoning=False).choices[0].message
    assert raw.content == f"<think>{message.reasoning_content}</think>{message.content}"
    deltas, _ = ask_stream(client, response_format=fmt)
    assert joined(deltas, "content") == message.content
    # the answer continued past </think> follows the grammar from its first token
    closed = ask(client, SHOTS + [{"role": "assistant", "content": "<think>\nBlue.\n</think>\n"}],
                 continue_final_message=True, response_format=fmt).choices[0].message
    assert closed.reasoning_content is None
    jsonschema.validate(json.loads(closed.content), COLOR)


@pytest.mark.parametrize("field, value", [
    ("separate_reasoning", "no"), ("stream_reasoning", 1),
    ("chat_template_kwargs.enable_thinking", "no")])
def test_bad_reasoning_fields_are_refused(server, field, value):
    body: dict[str, Any] = {"messages": SHOTS, "max_tokens": 1}
    if "." in field:
        outer, inner = field.split(".")
        body[outer] = {inner: value}
    else:
        body[field] = value
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 400 and field in r.text


def test_grammar_after_cannot_be_sent(server):
    r = requests.post(server.url + "/generate", timeout=60, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 1, "grammar_after": "</think>"}})
    assert r.status_code == 400 and "grammar_after" in r.text


def test_responses_api_gives_a_reasoning_item(client):
    """/v1/responses: the thoughts as a reasoning item before the message, streamed as
    response.reasoning_text events."""
    whole = ask(client).choices[0].message
    kw = dict(model="", instructions=SYSTEM, input=SHOTS[1:], temperature=0,
              max_output_tokens=60)
    response = client.responses.create(**kw)
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text == whole.reasoning_content
    assert message.type == "message" and response.output_text == whole.content
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == whole.reasoning_content
    final = events[-1].response
    assert final.output[0].content[0].text == whole.reasoning_content
    assert final.output_text == whole.content

"""Structural tags: SGLang's `structural_tag` (sampling parameter and response_format) and the
grammar that makes `strict` function tools hold under tool_choice auto. The grammars are
compiled by the real xgrammar backend for the bundled tokenizer and run on real token ids;
one server test shows the constraint on the model's own output."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from minisgl.errors import InvalidRequest
from minisgl.grammar import create_grammar_backend
from minisgl.protocol.openai_tools import ToolUse, parse_calls

EOS = 2  # <|im_end|>
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
GOOD_ARGS = '{"city": "Paris", "unit": "celsius", "days": 2}'
BAD_ARGS = '{"city": "Paris", "unit": "kelvin", "days": 2}'
CALL_TEXT = {  # parser style -> a call in its form, with the arguments left open
    "hermes": 'I will check. <tool_call>\n{{"name": "get_forecast", "arguments": {args}}}\n'
              '</tool_call>',
    "llama3": '{{"name": "get_forecast", "parameters": {args}}}',
    "mistral": 'Checking. [TOOL_CALLS] [{{"name": "get_forecast", "arguments": {args}}}]',
}


@pytest.fixture(scope="module")
def backend():
    from tests.reference import tokenizer
    return create_grammar_backend("xgrammar", tokenizer(), 49152)


def tools(strict: bool, parallel: bool = True) -> ToolUse:
    return ToolUse([{"type": "function", "function": {"name": "get_forecast",
                                                      "parameters": FORECAST,
                                                      "strict": strict}}], "auto", parallel)


def accepts(backend: Any, grammar: tuple[str, str], text: str) -> bool:
    """Whether the grammar takes the text's tokens and then the end of the answer."""
    from tests.reference import tokenizer
    matcher = backend.matcher(asyncio.run(backend.compile(*grammar)))
    ids = tokenizer()(text, add_special_tokens=False)["input_ids"] + [EOS]
    return all(matcher.accept_token(t) for t in ids) and matcher.is_terminated()


@pytest.mark.parametrize("parser", ["hermes", "llama3", "mistral"])
def test_strict_tools_constrain_auto_calls(backend, parser):
    grammar = tools(strict=True).grammar(parser, None)
    assert grammar[0] == "structural_tag"
    good = CALL_TEXT[parser].format(args=GOOD_ARGS)
    assert accepts(backend, grammar, good)
    assert not accepts(backend, grammar, CALL_TEXT[parser].format(args=BAD_ARGS))
    assert accepts(backend, grammar, "No call needed: it is sunny.")  # free text stays free
    content, calls = parse_calls(good, parser, {"get_forecast"})
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [json.loads(GOOD_ARGS)]
    assert tools(strict=False).grammar(parser, None) is None  # not strict: parsed as written


def test_strict_tools_with_a_json_answer_format(backend):
    answer = ("json_schema", json.dumps({"type": "object", "properties": {
        "summary": {"type": "string"}}, "required": ["summary"]}))
    grammar = tools(strict=True).grammar("hermes", answer)
    assert accepts(backend, grammar, '{"summary": "sunny"}')
    assert accepts(backend, grammar, CALL_TEXT["hermes"].format(args=GOOD_ARGS)
                   .removeprefix("I will check. "))
    assert not accepts(backend, grammar, "plain text")
    assert tools(strict=False).grammar("hermes", answer) == answer
    with pytest.raises(InvalidRequest, match="regex"):
        tools(strict=True).grammar("hermes", ("regex", "a+"))
    with pytest.raises(InvalidRequest, match="pythonic"):
        tools(strict=True).grammar("pythonic", None)


def test_one_strict_call_without_parallel_calls(backend):
    grammar = tools(strict=True, parallel=False).grammar("hermes", None)
    one = CALL_TEXT["hermes"].format(args=GOOD_ARGS)
    assert accepts(backend, grammar, one)
    assert accepts(backend, tools(strict=True).grammar("hermes", None),
                   one + "\n" + one.removeprefix("I will check. "))


def test_structural_tag_response_format_on_the_model(minisgl_server):
    """Listing the tools (auto, not strict) makes the model write `{"name": ...` objects of
    its own; a structural tag triggered there makes the object a call that follows the
    schema, in SGLang's older form (response_format) and xgrammar's (sampling parameter)."""
    client = openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Always answer by calling a tool inside "
                 "<tool_call></tool_call> tags."},
                {"role": "user", "content": "What's the 7-day forecast in Paris, in kelvin?"}]
    chat_tools = [{"type": "function", "function": {"name": "get_forecast",
                                                    "parameters": FORECAST}}]
    trigger = '{"name": '
    legacy = {"type": "structural_tag", "triggers": [trigger], "structures": [
        {"begin": '{"name": "get_forecast", "arguments": ', "schema": FORECAST, "end": "}"}]}
    free = client.chat.completions.create(model="m", messages=messages, tools=chat_tools,
                                          temperature=0, max_tokens=60)
    assert trigger in free.choices[0].message.content  # the model opens an object itself
    out = client.chat.completions.create(model="m", messages=messages, tools=chat_tools,
                                         temperature=0, max_tokens=120, response_format=legacy)
    text = out.choices[0].message.content
    match = re.search(r'\{"name": "get_forecast", "arguments": (\{.*?\})\}', text)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), FORECAST)
    current = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger], "stop_after_first": True,
        "tags": [{"type": "tag", "begin": legacy["structures"][0]["begin"],
                  "content": {"type": "json_schema", "json_schema": FORECAST}, "end": "}"}]}}
    again = client.chat.completions.create(model="m", messages=messages, tools=chat_tools,
                                           temperature=0, max_tokens=120,
                                           extra_body={"structural_tag": json.dumps(current)})
    assert again.choices[0].message.content.startswith(text[:match.end()])

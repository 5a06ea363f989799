"""OpenAI's harmony format (gpt-oss): the parser on written texts at every cut, the grammars
of constrained answers checked token by token with xgrammar, and a real server whose chat
template writes harmony (the bundled model copies it from a few turns; its markers are plain
text there, special tokens in gpt-oss, and the parser reads both alike)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import openai
import pytest
import requests
from jinja2 import Template

from minisgl.errors import InvalidRequest
from minisgl.grammar import create_grammar_backend
from minisgl.models import resolve_model_path
from minisgl.protocol.fields import UnknownFields
from minisgl.protocol.harmony import HarmonyParser, harmony_grammar
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_requests import parse_chat
from minisgl.protocol.openai_tools import ToolUse
from minisgl.runtime.tokenizer import Tokenizer
from tests.conftest import start_minisgl_server
from tests.test_responses import run_weather_agent

CALL_TEXT = ("<|channel|>analysis<|message|>The user wants the weather. Call it.<|end|>"
             "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}')
ANSWER_TEXT = ("<|channel|>analysis<|message|>Two plus two: four.<|end|>"
               "<|start|>assistant<|channel|>final<|message|>It is 4.")


def run_pieces(parser: HarmonyParser, pieces: list[str]) -> dict[str, Any]:
    """Every delta of a stream that grows by `pieces`, joined."""
    joined: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    text = ""
    deltas = []
    for piece in pieces:
        text += piece
        deltas.append(parser.feed(text))
    deltas.append(parser.finish())
    for delta in deltas:
        joined["reasoning"] += delta.reasoning
        joined["content"] += delta.content
        for call in delta.tool_calls:
            entry = joined["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    return joined


@pytest.mark.parametrize("text", [CALL_TEXT, ANSWER_TEXT])
def test_parser_splits_alike_at_every_cut(text):
    reasoning, content, calls = HarmonyParser({"get_weather"}).parse(text)
    whole = {"reasoning": reasoning or "", "content": content or "",
             "calls": {k: {"name": c["function"]["name"],
                           "arguments": c["function"]["arguments"]}
                       for k, c in enumerate(calls)}}
    for cut in range(len(text) + 1):
        assert run_pieces(HarmonyParser({"get_weather"}), [text[:cut], text[cut:]]) == whole
    assert run_pieces(HarmonyParser({"get_weather"}), list(text)) == whole


def test_parser_reads_each_channel_and_recipient():
    reasoning, content, calls = HarmonyParser({"get_weather"}).parse(CALL_TEXT)
    assert reasoning == "The user wants the weather. Call it." and content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert HarmonyParser(set()).parse(ANSWER_TEXT) == ("Two plus two: four.", "It is 4.", [])
    # the recipient before the channel; a function not among the tools stays visible content
    before = ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
              '{"city": "Rome"}')
    assert HarmonyParser({"get_weather"}).parse(before)[2][0]["function"]["arguments"] == (
        '{"city": "Rome"}')
    assert HarmonyParser({"other"}).parse(before) == (None, '{"city": "Rome"}', [])
    # text before any header is content; a header cut short is dropped
    assert HarmonyParser(set()).parse("Hello<|end|><|start|>assistant<|chan") == (
        None, "Hello", [])


def test_parser_options():
    two = CALL_TEXT + '<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather' \
        ' <|constrain|>json<|message|>{"city": "Rome"}'
    parser = HarmonyParser({"get_weather"}, one_call=True)
    assert [c["function"]["arguments"] for c in parser.parse(two)[2]] == ['{"city": "Paris"}']
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == (
        "length")
    # separate_reasoning false: the analysis joins the content
    assert HarmonyParser(set(), separate_reasoning=False).parse(ANSWER_TEXT) == (
        None, "Two plus two: four.It is 4.", [])
    # stream_reasoning false: the analysis in one piece, once it ended
    held = HarmonyParser(set(), stream_reasoning=False)
    assert [held.feed(ANSWER_TEXT[:k]).reasoning for k in (20, 45, 70)] == [
        "", "", "Two plus two: four."]
    # a call whose body never came has empty arguments, as a JSON object
    cut = CALL_TEXT[:CALL_TEXT.rindex("{")]
    assert HarmonyParser({"get_weather"}).parse(cut)[2][0]["function"]["arguments"] == "{}"


def test_a_continued_message_is_read_as_the_answers_start():
    """continue_final_message: the answer goes on in the message the prefix left open."""
    thinking = "<|channel|>analysis<|message|>Two plus"
    assert HarmonyParser(set(), prefix=thinking).parse(
        " two.<|end|><|start|>assistant<|channel|>final<|message|>4.") == (" two.", "4.", [])
    calling = CALL_TEXT[:CALL_TEXT.rindex('"Paris"')]
    parser = HarmonyParser({"get_weather"}, prefix=calling)
    first = parser.feed("")  # the open call goes out first, with what the prefix wrote
    assert [(c["function"].get("name"), c["function"]["arguments"]) for c in first.tool_calls
            ] == [("get_weather", '{"city": ')]
    rest = parser.feed('"Rome"}')
    assert rest.tool_calls[0]["function"]["arguments"] == '"Rome"}'
    assert parser.calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    assert (parser.reasoning, parser.content) == ("", "")


def harmony_model() -> OpenAIModel:
    return OpenAIModel(["m"], {"m"}, False, 4096, {}, "gpt-oss", "gpt-oss")


def test_a_harmony_request_keeps_markers_and_reads_reasoning_effort():
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello",
                          "reasoning_content": "Greet back."},
                         {"role": "user", "content": "Bye"}],
            "reasoning_effort": "high", "stop": "STOP"}
    chat = parse_chat(body, harmony_model(), True, 8, UnknownFields())
    [prompt] = chat.prompts
    assert prompt.chat.template_kwargs["reasoning_effort"] == "high"
    assert prompt.chat.messages[1]["thinking"] == "Greet back."
    assert not prompt.params.skip_special_tokens
    assert prompt.params.stop == ["STOP", "<|return|>", "<|call|>"]
    with pytest.raises(InvalidRequest, match="reasoning_effort"):
        parse_chat({**body, "reasoning_effort": "extreme"}, harmony_model(), True, 8,
                   UnknownFields())
    plain = OpenAIModel(["m"], {"m"}, False, 4096, {}, "hermes")
    with pytest.raises(InvalidRequest, match="reasoning_effort"):
        parse_chat(body, plain, True, 8, UnknownFields())


# ---- constrained answers, token by token ------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# the 135M model writes a city's name reliably only when it is one of a few
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": [
        "Paris", "Rome", "Tokyo"]}}, "required": ["city"]}}}
COLOR = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
CALL = ('<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
ANALYSIS = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
FINAL_JSON = '<|channel|>final<|message|>{"color": "blue"}<|return|>'


@pytest.fixture(scope="module")
def grammars():
    hf = Tokenizer.load(resolve_model_path(None)).hf
    backend = create_grammar_backend("xgrammar", hf, len(hf))

    def accepts(grammar: tuple[str, str], text: str) -> bool:
        matcher = backend.matcher(asyncio.run(backend.compile(*grammar)))
        ids = hf(text, add_special_tokens=False)["input_ids"]
        # NOTE: the answer may end there: the end of text is accepted
        return all(matcher.accept_token(t) for t in [*ids, hf.eos_token_id])
    return accepts


@pytest.mark.parametrize("choice, text, ok", [
    ("required", CALL, True), ("required", ANALYSIS + CALL, True),
    ("required", ANALYSIS + FINAL_JSON, False), ("required", "<|channel|>analysis<|message|>"
                                                 "Think.<|return|>", False),
    ("get_weather", ANALYSIS + CALL, True),
    ("get_weather", CALL.replace('"city"', '"town"'), False),
])
def test_required_and_named_tools_force_a_call(grammars, choice, text, ok):
    grammar = harmony_grammar(ToolUse([WEATHER], choice), None)
    assert grammars(grammar, text) is ok


def test_an_answer_format_constrains_the_final_message(grammars):
    answer = ("json_schema", json.dumps(COLOR))
    assert grammars(harmony_grammar(None, answer), ANALYSIS + FINAL_JSON)
    assert grammars(harmony_grammar(None, answer), FINAL_JSON)
    assert not grammars(harmony_grammar(None, answer),
                        ANALYSIS + "<|channel|>final<|message|>blue<|return|>")
    assert harmony_grammar(ToolUse([WEATHER], "auto"), None) is None  # free text
    with pytest.raises(InvalidRequest, match="tool_choice"):
        harmony_grammar(ToolUse([WEATHER], "required"), answer)


# ---- a real server ------------------------------------------------------------------------------

TEMPLATE = """\
<|start|>system<|message|>Reasoning: {{ reasoning_effort or 'medium' }}<|end|>
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|start|>developer<|message|>{{ m.content }}
{%- for t in tools or [] %} {{ t.function.name }}: {{ t.function.description }}{% endfor -%}
<|end|>
{%- elif m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' -%}
{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>
{%- endif -%}
{%- for c in m.tool_calls or [] -%}<|start|>assistant<|channel|>commentary \
to=functions.{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments }}<|call|>
{%- endfor -%}
{%- if m.content -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|return|>
{%- endif -%}
{%- elif m.role == 'tool' -%}<|start|>functions.get_weather to=assistant<|channel|>commentary\
<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""
SHOTS = [
    {"role": "system", "content": "Think in the analysis channel, then answer in the final one."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "thinking": "Two plus two is four.", "content": "The answer is 4."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "thinking": "France's capital is Paris.",
     "content": "The answer is Paris."},
    {"role": "user", "content": "What color is the sky?"},
]
ROUND_TRIP = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Call get_weather.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
]


@pytest.fixture(scope="module")
def server():
    # NOTE: one parser flag sets both (the format carries reasoning and calls together)
    server = start_minisgl_server("--tool-call-parser", "gpt-oss", "--chat-template", TEMPLATE,
                                  "--constrained-json-disable-any-whitespace")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)


def stream(client: openai.OpenAI, **kw: Any) -> tuple[dict[str, Any], str | None]:
    """A streamed answer's joined deltas and its finish_reason."""
    joined: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": {}}
    reason = None
    for chunk in client.chat.completions.create(model="m", temperature=0, stream=True, **kw):
        delta = chunk.choices[0].delta
        joined["reasoning_content"] += delta.reasoning_content or ""
        joined["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            entry = joined["calls"].setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return joined, reason


@pytest.mark.parametrize("question", ["What is 3+3?", "What color is the sky?"])
def test_the_answer_is_the_parse_of_what_the_model_wrote(client, server, question):
    messages = SHOTS[:-1] + [{"role": "user", "content": question}]
    answer = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                            max_tokens=60)
    message = answer.choices[0].message
    prompt = Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    raw = requests.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 60, "skip_special_tokens": False,
        "stop": ["<|return|>", "<|call|>"]}}).json()["text"]
    assert raw.startswith("<|channel|>") and (message.reasoning_content or message.content)
    assert (message.reasoning_content, message.content, []) == HarmonyParser(set()).parse(raw)
    joined, reason = stream(client, messages=messages, max_tokens=60)
    assert joined["reasoning_content"] == (message.reasoning_content or "")
    assert joined["content"] == (message.content or "") and reason == (
        answer.choices[0].finish_reason)


def test_a_json_answer_follows_the_analysis(client):
    kw = {"messages": SHOTS[:-1] + [{"role": "user", "content": "What is 3+3?"}],
          "max_tokens": 120, "response_format": {
              "type": "json_schema", "json_schema": {"name": "sum", "schema": {
                  "type": "object", "properties": {"sum": {"type": "integer"}},
                  "required": ["sum"]}}}}
    message = client.chat.completions.create(model="m", temperature=0, **kw).choices[0].message
    assert message.reasoning_content and isinstance(json.loads(message.content)["sum"], int)
    joined, _ = stream(client, **kw)
    assert (joined["reasoning_content"], joined["content"]) == (message.reasoning_content,
                                                                message.content)


def test_a_required_call_streams_as_it_answers(client):
    kw = {"messages": SHOTS[:1] + [{"role": "user", "content": "Weather in Rome?"}],
          "tools": [CITY_TOOL], "tool_choice": "required", "max_tokens": 100}
    answer = client.chat.completions.create(model="m", temperature=0, **kw)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Tokyo")
    assert answer.choices[0].finish_reason == "tool_calls"
    joined, reason = stream(client, **kw)
    assert joined["calls"] == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert reason == "tool_calls"


def test_a_tool_result_round_trip_reaches_the_template(client, server):
    answer = client.chat.completions.create(model="m", messages=ROUND_TRIP, tools=[WEATHER],
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    ids = requests.post(server.url + "/tokenize", json={
        "messages": ROUND_TRIP, "tools": [WEATHER]}).json()["tokens"]
    assert answer.usage.prompt_tokens == len(ids)
    text = requests.post(server.url + "/detokenize", json={"tokens": ids}).json()["text"]
    assert "analysis<|message|>Call get_weather.<|end|>" in text  # reasoning_content sent back
    assert "22 degrees and sunny" in text


def test_a_reasoning_item_sent_back_reaches_the_template(client):
    """Responses input: a reasoning item before a call is that turn's thinking, as a chat
    message's reasoning_content is."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Call get_weather."}]},
             call, {"type": "function_call_output", "call_id": "call_1",
                    "output": "22 degrees and sunny"}]
    tools = [{"type": "function", **WEATHER["function"]}]

    def input_tokens(input_items: list[dict[str, Any]]) -> int:
        return client.responses.create(model="m", input=input_items, tools=tools,
                                       instructions="Use the tools.", temperature=0,
                                       max_output_tokens=1).usage.input_tokens
    chat = client.chat.completions.create(model="m", messages=ROUND_TRIP, tools=[WEATHER],
                                          temperature=0, max_tokens=1)
    assert input_tokens(items) == chat.usage.prompt_tokens > input_tokens(
        [item for item in items if item.get("type") != "reasoning"])


def test_reasoning_effort_reaches_the_template(server):
    def prompt(effort: str) -> str:
        ids = requests.post(server.url + "/tokenize", json={
            "messages": SHOTS, "reasoning_effort": effort}).json()["tokens"]
        return requests.post(server.url + "/detokenize", json={"tokens": ids}).json()["text"]
    assert "Reasoning: low" in prompt("low") and "Reasoning: high" in prompt("high")
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": SHOTS, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and "reasoning_effort" in r.json()["error"]["message"]


def test_responses_and_the_agents_sdk(server, client):
    # a response is the chat answer it stands for, split alike
    messages = [{"role": "system", "content": "Think first."},
                {"role": "user", "content": "What is 3+3?"}]
    r = client.responses.create(model="m", input=messages[1:], instructions=messages[0][
        "content"], temperature=0, max_output_tokens=60, reasoning={"effort": "low"})
    same = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                          max_tokens=60, reasoning_effort="low")
    message = same.choices[0].message
    assert r.reasoning.effort == "low"
    assert [(item.type, item.content[0].text) for item in r.output] == [
        (kind, text) for kind, text in (("reasoning", message.reasoning_content),
                                        ("message", message.content)) if text]
    # a strict tool (the SDK's default) under tool_choice required
    calls, result = run_weather_agent(server.url, "Use the tools.",
                                      Literal["Paris", "Rome", "Tokyo"], max_tokens=200)
    assert len(calls) == 1 and result.final_output == f"22 degrees and sunny in {calls[0]}"

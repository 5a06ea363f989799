"""Structured outputs and tool calls: grammar-constrained decoding inside the overlap loop,
against a real server with the real SmolLM2 (a 135M model that, unconstrained, rarely emits
valid JSON), through requests and the `openai` client; every output is checked with
`jsonschema` / `re.fullmatch`."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.test_server import assert_error, generate, post, requests_total, stream

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
PALETTE = {"type": "object", "properties": {
    "mood": {"type": "string", "enum": ["calm", "bold", "dark"]},
    "colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
               "minItems": 2, "maxItems": 4}},
    "required": ["mood", "colors"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
    "customer": PERSON,
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
    "required": ["id", "customer", "items"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "palette": PALETTE, "order": ORDER}
PROMPTS = ["Describe a person as JSON.", "Here is some data:", "Output:"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}


def constrained(server: Any, prompt: str, **sampling: Any) -> dict[str, Any]:
    return generate(server, {"text": prompt, "sampling_params": {"max_new_tokens": 160,
                                                                 **sampling}})


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from minisgl.models.weights import resolve_model_path
    from minisgl.runtime.tokenizer import Tokenizer
    return Tokenizer.load(resolve_model_path(None)).hf


def json_grammar(hf: Any, schema: dict[str, Any], any_whitespace: bool) -> tuple[Any, Any]:
    """(backend, compiled schema), compiled here in the test, the server's way."""
    from minisgl.grammar import create_grammar_backend
    backend = create_grammar_backend("xgrammar", hf, len(hf), any_whitespace=any_whitespace)
    return backend, asyncio.run(backend.compile("json_schema", json.dumps(schema)))


def json_skeleton(text: str) -> str:
    """The JSON text with every string literal emptied: what is left is its syntax."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(minisgl_server, hf_tokenizer, name, temperature):
    """Greedy, every output stops and validates. Sampled, every token is one the grammar
    allowed, and an output that stopped validates; under SGLang's default (any whitespace)
    SmolLM2 on these bare prompts may sample whitespace until max_new_tokens (BENCHMARKS.md,
    "JSON schemas: free whitespace")."""
    schema = SCHEMAS[name]
    backend, compiled = json_grammar(hf_tokenizer, schema, any_whitespace=True)
    for prompt in PROMPTS:
        out = constrained(minisgl_server, prompt, json_schema=json.dumps(schema),
                          temperature=temperature, sampling_seed=11)
        matcher = backend.matcher(compiled)
        assert all(matcher.accept_token(t) for t in out["output_ids"]), out
        if temperature == 0.0 or out["meta_info"]["finish_reason"]["type"] == "stop":
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize("pattern", [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no|maybe)",
                                     r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?"])
def test_regex_outputs_fullmatch(minisgl_server, pattern):
    for temperature in (0.0, 1.2):
        out = constrained(minisgl_server, "Answer:", regex=pattern, temperature=temperature)
        assert re.fullmatch(pattern, out["text"]), out["text"]


EBNF = """root ::= greeting " " name "!"
greeting ::= "Hello" | "Hi" | "Hey"
name ::= [A-Z] [a-z]{1,8}"""  # NOTE: bounded, so a sampled name ends within max_new_tokens


def test_ebnf_outputs_are_in_the_language(minisgl_server):
    for temperature in (0.0, 1.0):
        out = constrained(minisgl_server, "Greet someone:", ebnf=EBNF, temperature=temperature,
                          max_new_tokens=24)
        assert re.fullmatch(r"(Hello|Hi|Hey) [A-Z][a-z]{1,8}!", out["text"]), out["text"]


def test_streaming_with_a_schema(minisgl_server):
    chunks = stream(minisgl_server, {"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 160, "temperature": 0, "json_schema": json.dumps(PERSON)}})
    jsonschema.validate(json.loads(chunks[-1]["text"]), PERSON)
    whole = constrained(minisgl_server, PROMPTS[0], json_schema=json.dumps(PERSON),
                        temperature=0)
    assert chunks[-1]["output_ids"] == whole["output_ids"]


def test_grammar_rows_leave_free_rows_alone(minisgl_server):
    """A batch mixing free and constrained requests: the free ones' greedy output is what they
    give alone, and the constrained one's is what it gives alone."""
    free = {"max_new_tokens": 24, "temperature": 0}
    texts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    alone = [generate(minisgl_server, {"text": t, "sampling_params": free}) for t in texts]
    schema = {**free, "max_new_tokens": 160, "json_schema": json.dumps(PALETTE)}
    single = generate(minisgl_server, {"text": PROMPTS[1], "sampling_params": schema})
    mixed = generate(minisgl_server, {"text": [texts[0], PROMPTS[1], texts[1], texts[2]],
                                      "sampling_params": [free, schema, free, free]})
    assert [m["output_ids"] for i, m in enumerate(mixed) if i != 1] == [
        a["output_ids"] for a in alone]
    assert mixed[1]["output_ids"] == single["output_ids"]


def test_same_grammar_output_with_overlap_off(minisgl_server, minisgl_server_factory):
    plain = minisgl_server_factory("--disable-overlap-schedule")
    body = {"text": [PROMPTS[2], "Free text here"], "sampling_params": [
        {"max_new_tokens": 160, "temperature": 0, "json_schema": json.dumps(ORDER)},
        {"max_new_tokens": 40, "temperature": 0}]}
    assert [o["output_ids"] for o in generate(plain, body)] == [
        o["output_ids"] for o in generate(minisgl_server, body)]


def test_bad_grammars_get_400_and_disturb_nothing(minisgl_server):
    before = requests_total(minisgl_server)
    bad = [({"json_schema": '{"type": "nope"}'}, "json_schema"),
           ({"json_schema": "{not json"}, "json_schema"),
           ({"regex": "(unclosed"}, "regex"),
           ({"ebnf": "root ::= "}, "ebnf"),
           ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one")]
    for sampling, word in bad:
        error = assert_error(post(minisgl_server, "/generate", {
            "text": ["ok", "x"], "sampling_params": [{"max_new_tokens": 2}, sampling]}), 400)
        assert word in error["message"], error
    assert requests_total(minisgl_server) == before  # the good item was not queued either
    assert generate(minisgl_server, {"text": "fine", "sampling_params": {
        "max_new_tokens": 2}})["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("any_whitespace", [True, False])
def test_json_schema_whitespace_setting(hf_tokenizer, any_whitespace):
    """SGLang's default: a JSON schema lets the model put any whitespace between tokens. With
    --constrained-json-disable-any-whitespace only json.dumps's own form is allowed (one space
    after `:` and `,`, as SGLang's xgrammar backend then compiles it)."""
    hf = hf_tokenizer
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "array", "items": {"type": "string"}}},
              "required": ["a", "b"], "additionalProperties": False}
    backend, compiled = json_grammar(hf, schema, any_whitespace)

    def accepts(text: str) -> bool:
        matcher = backend.matcher(compiled)
        ids = hf.encode(text, add_special_tokens=False) + [hf.eos_token_id]
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()

    assert accepts('{"a": 1, "b": ["x y", "z"]}')
    for spaced in ('{"a":1,"b":["x y","z"]}', '{\n  "a": 1,\n  "b": [\n    "x y"\n  ]\n}',
                   '{ "a" : 1 , "b" : [ ] }'):
        assert accepts(spaced) == any_whitespace, spaced
    assert not accepts('{"a": 1, "b": ["x y"], "c": 2}')


def test_disable_any_whitespace_flag_gives_compact_json(minisgl_server_factory):
    """The flag reaches the grammar backend: every output, greedy or sampled, stops, validates
    and has json.dumps's spacing, no other whitespace outside strings (one prompt per schema:
    the default server's tests cover the prompts)."""
    server = minisgl_server_factory("--constrained-json-disable-any-whitespace")
    cases = [(SCHEMAS[name], PROMPTS[0], t) for name in sorted(SCHEMAS) for t in (0.0, 1.0)]
    outs = generate(server, {"text": [prompt for _, prompt, _ in cases], "sampling_params": [
        {"json_schema": json.dumps(schema), "temperature": t, "sampling_seed": 11,
         "max_new_tokens": 160} for schema, _, t in cases]})
    for (schema, _, _), out in zip(cases, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
        skeleton = json_skeleton(out["text"])
        assert skeleton.replace(": ", ":").replace(", ", ",") == "".join(
            skeleton.split()), out["text"]
        assert ":" not in skeleton.replace(": ", "") and "," not in skeleton.replace(
            ", ", ""), out["text"]


# ---- OpenAI: response_format and tools ----------------------------------------------------------

@pytest.fixture(scope="module")
def client(minisgl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="x", max_retries=0,
                         timeout=180)


def ask(client: openai.OpenAI, content: str, **kw: Any) -> Any:
    return client.chat.completions.create(model="", messages=[{"role": "user",
                                                               "content": content}],
                                          max_tokens=160, temperature=0, **kw)


def test_response_format_json_schema_and_json_object(client):
    out = ask(client, "Describe a person.", response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    # NOTE: a prompt SmolLM2 answers in a few tokens; "a short JSON object about Paris"
    # greedily runs into a number of endless digits
    out = ask(client, "Give me a JSON object with the name and country of Paris.",
              max_completion_tokens=300,
              response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    completion = client.completions.create(model="", prompt="Person:", max_tokens=160,
                                           temperature=0, extra_body={"regex": "(yes|no)"})
    assert completion.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        ask(client, "x", response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_tool_calls_required_and_named(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = ask(client, "What is the weather in Paris?", tools=[WEATHER, TIME],
                  tool_choice=choice)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert [c.function.name for c in message.tool_calls] == ["get_weather"]


def test_tool_calls_streamed_and_round_trip(client):
    chunks = list(client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=[WEATHER], tool_choice="required", max_tokens=160, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls
             for tc in c.choices[0].delta.tool_calls]
    # the first delta of a call has its id and name, its arguments come in pieces after it
    assert calls and calls[0].index == 0 and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    messages = [{"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": calls[0].id, "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C and sunny"}]
    out = client.chat.completions.create(model="", messages=messages, tools=[WEATHER],
                                         max_tokens=24, temperature=0)
    # NOTE: the conversation is taken; SmolLM2 may answer or call again (a call cut by
    # max_tokens is a call with its arguments so far, finish_reason "length")
    assert out.choices[0].message.content or out.choices[0].message.tool_calls


def test_tool_call_parsers():
    from minisgl.protocol.openai_tools import parse_calls
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_calls(text, "hermes", {"get_weather"})
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Oslo"}
    content, calls = parse_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', "llama3",
                                 {"get_time"})
    assert content is None and calls[0]["function"]["name"] == "get_time"
    assert parse_calls("just text", "hermes", {"get_time"}) == ("just text", [])
    # SGLang's name for Qwen2.5's calls, which are hermes-style blocks
    content, calls = parse_calls(text, "qwen25", {"get_weather"})
    assert content == "Let me check." and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert parse_calls('{"name": "other"}', "llama3", {"get_time"})[1] == []
    content, calls = parse_calls('Sure. [get_time(zone="UTC")]', "pythonic", {"get_time"})
    assert content == "Sure." and [c["function"] for c in calls] == [
        {"name": "get_time", "arguments": '{"zone": "UTC"}'}]


def test_bad_tool_requests(minisgl_server):
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for body, word in [({"tools": [WEATHER], "tool_choice": {
                            "type": "function", "function": {"name": "nope"}}}, "nope"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"tools": [{"type": "function"}]}, "tools"),
                       ({"tools": [WEATHER], "tool_choice": "required",
                         "response_format": {"type": "json_object"}}, "tool_choice")]:
        assert word in assert_error(post(minisgl_server, "/v1/chat/completions",
                                         {**base, **body}), 400)["message"]


def test_offline_grammar_through_retraction_and_chunked_prefill():
    """The offline LLM takes the same sampling fields. 40 digits (one token each here) keep
    every request running to its limit, so a small pool must retract some; their matchers keep
    the tokens already accepted, and the outputs still match. Then chunked prefills."""
    from minisgl import LLM
    pattern = "[0-9]{40}"
    prompts = [f"Numbers for row {i}, listed one by one: " * 3 for i in range(12)]
    with LLM(dtype="float32", max_total_tokens=400, max_running_requests=12) as llm:
        outs = llm.generate(prompt=prompts, sampling_params={
            "max_new_tokens": 41, "temperature": 0.8, "sampling_seed": 3, "regex": pattern})
        assert all(re.fullmatch(pattern, o["text"]) for o in outs), [o["text"] for o in outs]
        assert llm.runtime.state()["retractions"] > 0
        llm.check_integrity()
    with LLM(dtype="float32", max_total_tokens=4000, chunked_prefill_size=16) as llm:
        outs = llm.generate(prompt=prompts[:4], sampling_params={
            "max_new_tokens": 160, "temperature": 0, "json_schema": json.dumps(PERSON)})
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), PERSON)
        llm.check_integrity()

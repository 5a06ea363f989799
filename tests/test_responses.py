"""OpenAI's Responses API (/v1/responses) driven by the `openai` client and the Agents SDK
against a real server. A response runs the chat completion it stands for, so greedy answers
are checked against /v1/chat/completions with the equivalent messages."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import jsonschema
import openai
import pytest
import requests

from tests.conftest import start_minisgl_server
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

STORED = 3  # --max-stored-responses
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    server = start_minisgl_server("--max-stored-responses", str(STORED))
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def chat(client: openai.OpenAI, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_plain_response_is_the_chat_answer(client):
    r = client.responses.create(model="m", input=QUESTION, instructions="Answer briefly.",
                                temperature=0, max_output_tokens=40)
    same = chat(client, [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": QUESTION}], max_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == same.choices[0].message.content and r.output_text
    assert r.status == ("completed" if same.choices[0].finish_reason == "stop" else "incomplete")
    assert r.usage.input_tokens == same.usage.prompt_tokens
    assert r.usage.output_tokens == same.usage.completion_tokens
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 40


def test_stream_events_in_openai_order(client):
    kw = dict(model="m", input=[{"role": "user", "content": "Tell me a story."}],
              temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.status == whole.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"
    assert events[2].item.id == final.output[0].id == events[-2].item.id


def test_function_tool_round_trip(client):
    first = client.responses.create(model="m", input="What is the weather in Paris?",
                                    tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    result = "22 degrees and sunny"
    second = client.responses.create(
        model="m", previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}],
        temperature=0, max_output_tokens=30)
    same = chat(client, [{"role": "user", "content": "What is the weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": "get_weather",
                                           "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": result}],
                tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                         if k != "type"}}],
                tool_choice="none", max_tokens=30)
    assert second.output_text == same.choices[0].message.content
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert second.previous_response_id == first.id


def test_streamed_function_call(client):
    events = list(client.responses.create(
        model="m", input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done.arguments and json.loads(pieces)["city"]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[0].arguments == pieces


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model="m", input="Describe a person as JSON.", temperature=0,
                                max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_previous_response_and_the_store(client, server):
    first = client.responses.create(model="m", input="My name is Ada.", temperature=0,
                                    max_output_tokens=20)
    second = client.responses.create(model="m", input="What is my name?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=20)
    same = chat(client, [{"role": "user", "content": "My name is Ada."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], max_tokens=20)
    assert second.output_text == same.choices[0].message.content
    assert second.usage.input_tokens == same.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id).data
    assert [i.type for i in items] == ["message"] and items[0].content[0].text == \
        "What is my name?"
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model="m", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="m", input="hi", previous_response_id="resp_missing")
    later = [client.responses.create(model="m", input="hi", max_output_tokens=1).id
             for _ in range(STORED)]
    with pytest.raises(openai.NotFoundError):  # the oldest went first
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(later[0]).id == later[0]


@pytest.mark.parametrize("body,contains", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "image_url must be an http(s) or data: URL"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input_file"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests_name_the_field(server, body, contains):
    r = requests.post(server.url + "/v1/responses", json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert contains in r.json()["error"]["message"]


def run_weather_agent(url: str, instructions: str, city_type: Any = str,
                      max_tokens: int = 100) -> tuple[list[str], Any]:
    """The Agents SDK's agent with one function tool (strict, its default) against the server
    at `url`: (the cities the tool was called with, the run's result)."""
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"22 degrees and sunny in {city}"

    get_weather.__annotations__["city"] = city_type
    tool = agents.function_tool(get_weather)

    async def run() -> Any:
        agents.set_tracing_disabled(True)
        model = agents.OpenAIResponsesModel(
            "m", openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused"))
        # NOTE: the 135M model keeps calling tools once it may, so the tool's result ends the
        # run (the model's own follow-up turn is covered by test_function_tool_round_trip)
        agent = agents.Agent(name="weather", instructions=instructions, tools=[tool],
                             model=model, tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(
                                 temperature=0, tool_choice="required",
                                 parallel_tool_calls=False, max_tokens=max_tokens))
        return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)

    return calls, asyncio.run(run())


def test_agents_sdk_runs_a_function_tool(server):
    calls, result = run_weather_agent(server.url, "Answer with the weather tool.")
    assert calls == ["Paris"] and result.final_output == "22 degrees and sunny in Paris"

"""Tool calls streamed as they are written: the incremental parser on hand-written
texts fed at every split (no server), then the real `openai` SDK and LangChain against a real
server: arguments arrive in pieces that reassemble to the non-streamed answer's,
`parallel_tool_calls: false` bounds the answer to one call, and `auto` streams its content."""

from __future__ import annotations

import functools
import json
import operator
import random
import re
from typing import Any

import jsonschema
import openai
import pytest

from minisgl.protocol.openai_gemma4 import Gemma4CallParser
from minisgl.protocol.openai_pythonic import PythonicCallParser
from minisgl.protocol.openai_tool_parser import ToolCallParser
from minisgl.protocol.openai_tools import ToolUse
from tests.test_grammar import TIME, WEATHER

NAMES = {"get_weather", "get_time"}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}


# ---- the parser, no server --------------------------------------------------------------------

def run(parser: ToolCallParser, texts: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed the cumulative texts, then finish; reassemble the deltas as a client does, and
    check their shape (a header first, once per call, alone with arguments "" until the
    finish; one entry per call per delta)."""
    content, calls = "", {}
    deltas = [parser.feed(t) for t in texts]
    for k, delta in enumerate([*deltas, parser.finish()]):
        content += delta.content
        if k < len(deltas):
            assert all(c["function"]["arguments"] == "" for c in delta.tool_calls if "id" in c)
        indexes = [c["index"] for c in delta.tool_calls]
        assert len(indexes) == len(set(indexes)), delta
        for c in delta.tool_calls:
            if "id" in c:
                assert c["index"] == len(calls) and c["type"] == "function", delta
                assert c["id"].startswith("call_") and c["function"]["name"]
                calls[c["index"]] = [c["function"]["name"], ""]
            calls[c["index"]][1] += c["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


def check(make: Any, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    """The whole text at once, every character alone, and every split into two pieces give
    the same content and calls, and those expected."""
    whole = make()
    got = whole.parse(text)
    assert got[0] == content, got
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got[1]] == calls
    expected = (content or "", calls)
    assert run(make(), [text[:i] for i in range(len(text) + 1)]) == expected
    for i in range(len(text) + 1):
        assert run(make(), [text[:i], text]) == expected, i


def hermes(one_call: bool = False) -> ToolCallParser:
    return ToolCallParser("hermes", NAMES, one_call)


def test_hermes_content_and_calls():
    check(hermes, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Oslo"}}\n</tool_call>', "Let me check.", [("get_weather", '{"city": "Oslo"}')])
    two = ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
           'and <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n\nok ')
    check(hermes, two, "and ok ", [("get_time", '{"zone": "UTC"}'), ("get_weather", "{}")])
    check(lambda: hermes(one_call=True), two, "and ok ", [("get_time", '{"zone": "UTC"}')])


def test_hermes_json_scanner_edge_cases():
    tricky = r'{"city": "a \"}\" {[b\\", "n": {"x": [1, {"y": "}]"}], "z": null}}'
    check(hermes, f'<tool_call>{{"name": "get_weather", "arguments": {tricky}, "x": 1}}'
          '</tool_call>', None, [("get_weather", tricky)])
    # the name after the arguments; no arguments at all; a scalar after the name
    check(hermes, '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>',
          None, [("get_time", '{"zone": "UTC"}')])
    check(hermes, '<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", "{}")])
    check(hermes, '<tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool_call>',
          None, [("get_time", '{"zone":"UTC"}')])
    # an escaped quote inside the name, a repeated key: the first one counts
    check(hermes, '<tool_call>{"name": "get_time", "name": "x", "arguments": {"a": 1}, '
          '"arguments": {"b": 2}}</tool_call>', None, [("get_time", '{"a": 1}')])


def test_hermes_what_is_not_a_call_stays_content():
    for text in ['Hi <tool_call>{"name": "nope", "arguments": {}}</tool_call> bye',
                 '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                 '<tool_call>hello</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name" "get_time"}</tool_call>', "a <tool", "a <tool_call",
                 "Hello\n\n world \n", "", "x </tool_call> <tool_cal",
                 'Sure <tool_call>{"na', 'Sure <tool_call>{"name": "get_ti',
                 "a \n<tool_call>hello</tool_call>", "x\n<tool_call>\n ",
                 r'<tool_call>{"na\qme": "get_time"}', r'<tool_call>{"name": "get\q"}']:
        check(hermes, text, text, [])
    # a known name is a call, sent at once: an object that breaks after it ends the call there
    check(hermes, '<tool_call>{"name": "get_time"] x', "] x", [("get_time", "")])
    # an unknown call, then a known one: the first stays content
    check(hermes, 'a <tool_call>{"name": "x"}</tool_call> <tool_call>{"name": "get_time", '
          '"arguments": {}}</tool_call>', 'a <tool_call>{"name": "x"}</tool_call>',
          [("get_time", "{}")])


def test_hermes_cut_short():
    text = 'Well <tool_call>{"name": "get_weather", "arguments": {"city": "Os'
    check(hermes, text, "Well", [("get_weather", '{"city": "Os')])
    parser = hermes()
    parser.parse(text)
    assert parser.finish_reason("length") == "length"
    assert parser.finish_reason("stop") == "stop"  # a stop string inside the call
    done = hermes()
    done.parse(text + '"}}')
    assert done.finish_reason("stop") == "tool_calls" and done.finish_reason("length") == "length"
    assert hermes().finish_reason("stop") == "stop"  # no call made


def test_hermes_streams_as_written():
    text = 'Let me see. <tool_call>{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}'
    parser, got = hermes(), []
    for i in range(len(text) + 1):
        got.append((i, parser.feed(text[:i])))
    content_at = min(i for i, d in got if d.content)
    assert content_at <= len("Let me")  # content goes out before the answer ends
    header_at = min(i for i, d in got if d.tool_calls)
    assert text[:header_at].endswith('"get_time"')  # the header, once the name closed
    pieces = [d.tool_calls[0]["function"]["arguments"] for _, d in got if d.tool_calls]
    assert pieces[0] == "" and len([p for p in pieces if p]) > 5
    assert "".join(pieces) == '{"zone": "Europe/Oslo"}'


def llama3(one_call: bool = False) -> ToolCallParser:
    return ToolCallParser("llama3", NAMES, one_call)


def test_llama3():
    check(llama3, '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
          [("get_time", '{"zone": "UTC"}')])
    both = ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
            '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}')
    calls = [("get_time", '{"zone": "UTC"}'),
             ("get_weather", '{"city": "Rome", "unit": "celsius"}')]
    check(llama3, both, None, calls)
    check(lambda: llama3(one_call=True), both, None, calls[:1])
    check(llama3, '\n {"name": "get_time", "arguments": 5} ', None, [("get_time", "5")])
    check(llama3, 'I think. <|python_tag|>{"name": "get_time", "arguments": {}}', "I think.",
          [("get_time", "{}")])
    for text in ['{"name": "other"}', 'Plain answer {"x"}', "  just text ",
                 '{"name": "get_tim', '{"a": "b"}', "I <|python_ta"]:
        check(llama3, text, text, [])


def test_required_array_and_named():
    array = ('[{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}},'
             '{"name":"get_time","arguments":{"zone":"CET"}}]')
    calls = [("get_weather", '{"city":"Paris","unit":"celsius"}'),
             ("get_time", '{"zone":"CET"}')]
    check(lambda: ToolCallParser("array", NAMES), array, None, calls)
    check(lambda: ToolCallParser("array", NAMES, one_call=True), array, None, calls[:1])
    check(lambda: ToolCallParser("array", NAMES), '[{"name":"get_time","arguments":{"zone":"C',
          None, [("get_time", '{"zone":"C')])
    check(lambda: ToolCallParser("array", NAMES), '[{"name":"zz","arguments":{}}]',
          '[{"name":"zz","arguments":{}}]', [])
    check(lambda: ToolCallParser("named", NAMES, named="get_time"), '{"zone":"CET"}', None,
          [("get_time", '{"zone":"CET"}')])
    check(lambda: ToolCallParser("named", NAMES, named="get_time"), "", None, [("get_time", "")])


def random_text(rng: random.Random, style: str) -> tuple[str, list[tuple[str, str]] | None]:
    """Calls as `style` writes them (arguments with nesting, escapes and braces in strings),
    with text around them, then at times cut or with a call-like fragment thrown in; and the
    calls it holds (None if cut or changed)."""
    def value(depth: int) -> str:
        kind = rng.randrange(4 if depth < 2 else 2)
        if kind == 0:
            return json.dumps(rng.choice(["a", 'q"}{', "\\", "]", "x y", "é"]))
        if kind == 1:
            return rng.choice(["1", "-2.5", "true", "null"])
        if kind == 2:
            return "[" + ", ".join(value(depth + 1) for _ in range(rng.randrange(3))) + "]"
        return "{" + ", ".join(f'"k{i}": {value(depth + 1)}' for i in range(rng.randrange(3))) + "}"

    calls, known = [], []
    for _ in range(rng.randint(1, 3)):
        name = json.dumps(rng.choice(["get_time", "get_weather", "nope"]))
        args = value(1) if rng.random() < 0.2 else "{" + ", ".join(
            f'"a{i}": {value(1)}' for i in range(rng.randrange(3))) + "}"
        fields = [f'"name": {name}', f'"{rng.choice(["arguments", "parameters"])}": {args}']
        if rng.random() < 0.2:
            fields.reverse()
        calls.append("{" + rng.choice([", ", ","]).join(fields) + "}")
        known.append((json.loads(name), args))
    if style == "hermes":
        text = "".join(rng.choice(["", "Sure. ", "\n", " ok "]) + "<tool_call>"
                       + rng.choice(["", "\n"]) + c + rng.choice(["", "\n"]) + "</tool_call>"
                       for c in calls) + rng.choice(["", " done", "\n\n"])
    elif style == "llama3":
        text = rng.choice(["", " ", "<|python_tag|>", "Hm <|python_tag|>"]) + "; ".join(calls)
    else:
        text = "[" + ",".join(calls) + "]"
    if style == "hermes":  # calls of unknown functions stay content
        known = [c for c in known if c[0] != "nope"]
    else:  # the calls up to the first unknown one, which and what follows are content
        known = known[:next((i for i, c in enumerate(known) if c[0] == "nope"), len(known))]
    if rng.random() < 0.3:
        return text[:rng.randrange(len(text))], None
    if rng.random() < 0.3:
        at = rng.randrange(len(text))
        return text[:at] + rng.choice(["<tool_call>", "{", "}", '"', "\\", "\\q", " ",
                                       "<tool", "</tool_call>", ";", ",", "]"]) + text[at:], None
    return text, known


@pytest.mark.parametrize("style", ["hermes", "llama3", "array"])
def test_random_texts_stream_as_they_parse(style):
    """However a text is split, the stream reassembles to what the whole text parses to, and
    an intact text gives its calls, each call's arguments exactly as the model wrote them."""
    rng = random.Random(28)
    made = 0
    for _ in range(120):
        (text, known), one_call = random_text(rng, style), rng.random() < 0.3
        content, calls = ToolCallParser(style, NAMES, one_call).parse(text)
        made += len(calls)
        expected = (content or "", [(c["function"]["name"], c["function"]["arguments"])
                                    for c in calls])
        if known is not None:
            assert expected[1] == known[:1 if one_call else None], text
        assert run(ToolCallParser(style, NAMES, one_call),
                   [text[:i] for i in range(len(text) + 1)]) == expected, text
        for i in range(0, len(text) + 1, 3):
            assert run(ToolCallParser(style, NAMES, one_call), [text[:i], text]) == expected
    assert made > 50


def test_parallel_tool_calls_bounds_the_required_grammar():
    kind, text = ToolUse([WEATHER, TIME], "required", parallel=False).grammar("hermes", None)
    bounded = json.loads(text)
    assert kind == "json_schema" and bounded["maxItems"] == 1 and bounded["minItems"] == 1
    assert "maxItems" not in json.loads(ToolUse([WEATHER, TIME], "required").grammar(
        "hermes", None)[1])


# ---- a real server: the openai SDK and LangChain ----------------------------------------------

@pytest.fixture(scope="module")
def client(minisgl_server) -> Any:
    """conftest's server, the bundled SmolLM2 with its real weights: random weights (a cheaper
    reduced model) may fill a JSON grammar with whitespace, free between tokens as in SGLang,
    until max_tokens."""
    pytest.importorskip("xgrammar")
    return openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="x", max_retries=0,
                         timeout=180)


def chat(client: Any, content: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="", messages=[{"role": "user", "content": content}],
        **{"max_tokens": 160, "temperature": 0, **kw})


def reassemble(chunks: list[Any]) -> tuple[str, list[dict[str, Any]], list[Any]]:
    """(content, calls, the tool_call deltas) of a stream, as a client rebuilds them."""
    content, calls, deltas = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                deltas.append(tc)
                call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name,
                                                   "type": tc.type, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], deltas


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_streamed_arguments_match_the_whole_answer(client, choice):
    tool_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": choice}}
    # NOTE: one call at most, so the answer ends before max_tokens whatever the model says
    ask = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=False)
    prompt = "What is the weather in Paris?"
    chunks = list(chat(client, prompt, stream=True, **ask))
    whole = chat(client, prompt, **ask)
    _, calls, deltas = reassemble(chunks)
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    firsts = {}
    for tc in deltas:
        firsts.setdefault(tc.index, tc)
    assert all(tc.id.startswith("call_") and tc.type == "function" and tc.function.name
               for tc in firsts.values())
    pieces = [tc for tc in deltas if tc.index == 0 and tc.function.arguments]
    assert len(pieces) > 1  # the arguments arrive as they are written
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert whole.choices[0].finish_reason == "tool_calls"


def test_auto_stream_sends_content_as_it_comes(client):
    chunks = list(chat(client, "Say hello and tell me about Paris.", stream=True,
                       tools=[WEATHER], tool_choice="auto", max_tokens=24))
    with_content = [k for k, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    finish = [k for k, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert len(with_content) > 3 and with_content[0] < finish[0]
    content, calls, _ = reassemble(chunks)
    whole = chat(client, "Say hello and tell me about Paris.", tools=[WEATHER],
                 tool_choice="auto", max_tokens=24)
    assert content == (whole.choices[0].message.content or "")
    assert len(calls) == len(whole.choices[0].message.tool_calls or [])


def test_parallel_tool_calls_false_gives_one_call(client):
    prompt = ("Call get_weather for Paris, then for Rome, then for Oslo, then get_time for "
              "UTC, and then for CET: five calls.")
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", max_tokens=200)
    one = chat(client, prompt, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].finish_reason == "tool_calls"
    _, calls, _ = reassemble(list(chat(client, prompt, stream=True, parallel_tool_calls=False,
                                       **kw)))
    assert len(calls) == 1
    # allowed, several calls may come (how many is the model's choice)
    assert len(chat(client, prompt, parallel_tool_calls=True, **kw).choices[0].message
               .tool_calls) >= 1
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        chat(client, prompt, tools=[WEATHER], parallel_tool_calls="no")


def test_langchain_one_tool_call(client, minisgl_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=minisgl_server.url + "/v1", api_key="x",
                                      model="minisgl", temperature=0, max_tokens=160,
                                      max_retries=0)
    bound = llm.bind_tools([WEATHER, TIME], tool_choice="any", parallel_tool_calls=False)
    prompt = "What is the weather in Paris and the time in Tokyo?"
    streamed = functools.reduce(operator.add, bound.stream(prompt))
    for answer in (bound.invoke(prompt), streamed):
        assert len(answer.tool_calls) == 1 and not answer.invalid_tool_calls, answer
        call = answer.tool_calls[0]
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])


def mistral(one_call: bool = False) -> ToolCallParser:
    return ToolCallParser("mistral", NAMES, one_call)


def test_mistral():
    both = ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    calls = [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Rome"}')]
    check(mistral, both, None, calls)
    check(lambda: mistral(one_call=True), both, None, calls[:1])
    check(mistral, 'Checking. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}] Done.',
          "Checking. Done.", [("get_time", "{}")])
    check(mistral, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "C',
          None, [("get_time", '{"zone": "C')])
    for text in ['[TOOL_CALLS][{"name": "other"}]', "[TOOL_CALLS] not a list", "plain text",
                 "[TOOL_CA", '[{"name": "get_time", "arguments": {}}]']:
        check(mistral, text, text, [])


def pythonic(one_call: bool = False) -> PythonicCallParser:
    return PythonicCallParser(NAMES, one_call)


def test_pythonic():
    """`--tool-call-parser pythonic`: a Python list of calls anywhere in the text, literals
    converted to JSON, Llama 4's python tags dropped; what does not read as one is content."""
    both = '[get_time(zone="UTC"), get_weather(city=\'Rome\', days=3, metric=True, at=None)]'
    calls = [("get_time", '{"zone": "UTC"}'),
             ("get_weather", '{"city": "Rome", "days": 3, "metric": true, "at": null}')]
    check(pythonic, both, None, calls)
    check(lambda: pythonic(one_call=True), both, None, calls[:1])
    check(pythonic, "Checking. [get_time()] Done.", "Checking. Done.", [("get_time", "{}")])
    check(pythonic, '<|python_start|>[get_time(zone="a]b")]<|python_end|>', None,
          [("get_time", '{"zone": "a]b"}')])
    check(pythonic, "[get_weather(city='Nice', hours=(1, 2), tags=['x', \"y\"])]", None,
          [("get_weather", '{"city": "Nice", "hours": [1, 2], "tags": ["x", "y"]}')])
    for text in ["[other(a=1)]", "[get_time(1)]", "[get_time(zone=now())]", "see [1] and [2]",
                 "[get_time(zone='UT", "plain text", "<|python_sta", "[]", "a [link](x) b",
                 "[get_time(zone=1)}"]:
        check(pythonic, text, text, [])


def test_pythonic_random_texts_stream_as_they_parse():
    """Content and call lists mixed at random, fed at every split: the same content and calls
    as parsing the whole text."""
    rng = random.Random(7)
    for _ in range(40):
        pieces, calls = [], []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.5:
                pieces.append(rng.choice(["Sure.", "a [1] b", "x(y)", "ok"]))
            else:
                city = rng.choice(["Rome", "New York", "a'b", "[x]"])
                pieces.append(f"[get_weather(city={city!r})]")
                calls.append(("get_weather", json.dumps({"city": city})))
        text = " ".join(pieces)
        whole = pythonic().parse(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]] == calls
        expected = (whole[0] or "", calls)
        assert run(pythonic(), [text[:i] for i in range(len(text) + 1)]) == expected


def gemma4(one_call: bool = False) -> Gemma4CallParser:
    return Gemma4CallParser(NAMES, one_call)


Q = '<|"|>'  # Gemma 4's string quote


def test_gemma4():
    """`--tool-call-parser gemma4`: `<|tool_call>call:NAME{...}<tool_call|>` blocks anywhere
    in the text, Gemma's values (strings between its quote markers, bare keys, nested lists
    and objects) as JSON; what does not read as a call of a known function is content."""
    weather = (f"<|tool_call>call:get_weather{{city:{Q}Rome, Italy{Q},days:3,metric:true}}"
               "<tool_call|>")
    time = "<|tool_call>call:get_time{}<tool_call|>"
    calls = [("get_weather", '{"city": "Rome, Italy", "days": 3, "metric": true}'),
             ("get_time", "{}")]
    check(gemma4, weather + time, None, calls)
    check(lambda: gemma4(one_call=True), weather + "\n" + time, None, calls[:1])
    check(gemma4, f"Checking. {time} Done.", "Checking. Done.", [("get_time", "{}")])
    check(gemma4, f"<|tool_call>call:get_weather{{city:{Q}a}}<tool_call|>b{Q},at:null,"
          f"hours:[1, -2.5e1],where:{{lat:1.5,\"the name\":{Q}x{Q}}}}}<tool_call|>", None,
          [("get_weather", '{"city": "a}<tool_call|>b", "at": null, "hours": [1, -25.0], '
            '"where": {"lat": 1.5, "the name": "x"}}')])
    for text in ["<|tool_call>call:other{a:1}<tool_call|>", "<|tool_call>get_time{}<tool_call|>",
                 f"<|tool_call>call:get_time{{zone:{Q}UT", "plain text", "<|tool_ca",
                 "<|tool_call>call:get_time{zone:now()}<tool_call|>",
                 "<|tool_call>call:get_time{zone:1} x<tool_call|>",
                 "<|tool_call>call:get_time<tool_call|>"]:
        check(gemma4, text, text, [])


def test_gemma4_random_texts_stream_as_they_parse():
    """Content and calls mixed at random, fed at every split: the same content and calls as
    parsing the whole text."""
    rng = random.Random(11)
    for _ in range(40):
        pieces, calls = [], []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.5:
                pieces.append(rng.choice(["Sure.", "a <b> c", "{x:1}", "ok"]))
            else:
                city = rng.choice(["Rome", "New York", "a,b", "{x}:", "<|tool_call>"])
                pieces.append(f"<|tool_call>call:get_weather{{city:{Q}{city}{Q}}}<tool_call|>")
                calls.append(("get_weather", json.dumps({"city": city})))
        text = " ".join(pieces)
        whole = gemma4().parse(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole[1]] == calls
        expected = (whole[0] or "", calls)
        assert run(gemma4(), [text[:i] for i in range(len(text) + 1)]) == expected


def test_a_gemma4_server_reads_its_thoughts_and_calls_streamed_and_whole(
        minisgl_server_factory):
    """A server with --reasoning-parser gemma4 --tool-call-parser gemma4: an `auto` answer
    (here held by a regex to a thought and one call, the bundled model knowing nothing of
    Gemma's format) comes back as reasoning_content, content and that call, streamed and whole
    alike, with finish_reason tool_calls; the text keeps the special tokens the markers are
    (skip_special_tokens off for such a request)."""
    pytest.importorskip("xgrammar")
    server = minisgl_server_factory("--tool-call-parser", "gemma4", "--reasoning-parser",
                                    "gemma4")
    gemma = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=180)
    answer = (f"<|channel>thought\nThe tool knows.<channel|>Let me look.<|tool_call>"
              f"call:get_weather{{city:{Q}Paris, France{Q},days:2}}<tool_call|>")
    ask = dict(tools=[WEATHER, TIME], tool_choice="auto",
               extra_body={"regex": re.escape(answer)})
    whole = chat(gemma, "Weather in Paris?", **ask)
    message = whole.choices[0].message
    assert message.reasoning_content == "The tool knows."
    assert message.content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris, France", "days": 2})]
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(chat(gemma, "Weather in Paris?", stream=True, **ask))
    content, calls, _ = reassemble(chunks)
    assert content == message.content
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                   for c in chunks if c.choices) == message.reasoning_content
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]

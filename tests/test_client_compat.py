"""What real clients trip over: a complete answer on its last allowed token, the
logprob shapes OpenAI's schema promises, echo of token-id prompts, and the other servers'
ways to ask for a constrained answer (vLLM's structured_outputs / guided_*, llama.cpp's
grammar and response_format schema), each honoured or refused, never ignored. A real server,
the `openai` client, requests."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.test_server import PROMPT, assert_error, generate, post

MODEL = "default"  # as SGLang's examples send it
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}]


@pytest.fixture(scope="module")
def client(minisgl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def test_stop_token_on_the_last_allowed_token_is_a_stop(minisgl_server, client):
    """The answer's end-of-turn token sampled as token max_new_tokens: complete (`stop`)."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
    free = generate(minisgl_server, body)
    assert free["meta_info"]["finish_reason"]["type"] == "stop"
    budget = free["meta_info"]["completion_tokens"]  # the stop token included
    exact = generate(minisgl_server, {**body, "sampling_params": {
        "max_new_tokens": budget, "temperature": 0}})
    assert exact["meta_info"]["finish_reason"] == free["meta_info"]["finish_reason"]
    assert exact["text"] == free["text"]

    class Person(pydantic.BaseModel):
        name: str
        age: int

    unbounded = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON,
                                              response_format=Person, temperature=0,
                                              max_tokens=128)
    assert unbounded.choices[0].finish_reason == "stop"
    tokens = unbounded.usage.completion_tokens
    # the openai SDK raises LengthFinishReasonError on a `length` finish
    exact = client.chat.completions.parse(model=MODEL, messages=ASK_PERSON,
                                          response_format=Person, temperature=0,
                                          max_tokens=tokens)
    assert exact.choices[0].finish_reason == "stop"
    assert exact.choices[0].message.parsed == unbounded.choices[0].message.parsed
    with pytest.raises(openai.LengthFinishReasonError):  # one token short is cut, as before
        client.chat.completions.parse(model=MODEL, messages=ASK_PERSON, response_format=Person,
                                      temperature=0, max_tokens=tokens - 1)


def test_top_logprobs_under_a_grammar_list_only_allowed_tokens(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is Paris in France?"}],
        temperature=0, max_tokens=8, logprobs=True, top_logprobs=5,
        extra_body={"regex": "(yes|no), (certainly|maybe)"})
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content).startswith(out.choices[0].message.content)
    for entry in content:
        assert all(isinstance(alt.logprob, float) for alt in entry.top_logprobs)
        assert 1 <= len(entry.top_logprobs) <= 5
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    # after "yes" only "," may follow, and after ", " only the two words' first tokens
    assert min(len(e.top_logprobs) for e in content) < 5


def test_completion_logprobs_zero_gives_the_sampled_token(client):
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                        temperature=0, logprobs=0, stream=stream)
        chunks = list(out) if stream else [out]
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        values = [v for lp in logprobs for v in lp.token_logprobs]
        tops = [t for lp in logprobs for t in lp.top_logprobs]
        assert len(tokens) == len(tops) == 4
        assert tops == [{token: value} for token, value in zip(tokens, values)]


def test_echo_of_token_ids_keeps_special_tokens(client, minisgl_server):
    from tests import reference as ref
    ids = [0] * 5 + ref.prompt_ids(PROMPT)  # <|endoftext|> x5, then the text
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                    echo=True, logprobs=1)
    choice = out.choices[0]
    prompt_text = ref.tokenizer().decode(ids, skip_special_tokens=False)
    assert choice.text.startswith(prompt_text) and prompt_text.startswith("<|endoftext|>" * 5)
    assert "".join(choice.logprobs.tokens) == choice.text


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": PERSON}},
    {"structured_outputs": {"json": json.dumps(PERSON)}, "guided_decoding_backend": "xgrammar"},
    {"guided_json": PERSON},
    {"response_format": {"type": "json_object", "schema": PERSON}},  # llama.cpp's form
])
def test_other_servers_json_constraints_are_honoured(client, extra):
    out = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0,
                                         max_tokens=96, extra_body=extra)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": ["yes", "no", "it \"depends\""]}},
    {"guided_choice": ["yes", "no", "it \"depends\""]},
    {"structured_outputs": {"regex": "(yes|no|it \"depends\")"}},
    {"guided_regex": "(yes|no|it \"depends\")"},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "it \\"depends\\""'}},
    {"guided_grammar": 'root ::= "yes" | "no" | "it \\"depends\\""'},
    {"grammar": 'root ::= "yes" | "no" | "it \\"depends\\""'},  # llama.cpp's GBNF
])
def test_other_servers_choice_regex_and_grammar_are_honoured(client, extra):
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}],
                temperature=0, max_tokens=16, extra_body=extra)
            text = out.choices[0].message.content
        else:
            out = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:",
                                            temperature=0, max_tokens=16, extra_body=extra)
            text = out.choices[0].text
        assert text in ("yes", "no", 'it "depends"'), (extra, text)


def test_constraints_that_cannot_be_honoured_are_refused(minisgl_server):
    chat = {"messages": ASK_PERSON, "max_tokens": 4}
    for extra, field in (
            ({"structured_outputs": {"json": PERSON, "whitespace_pattern": " "}},
             "structured_outputs.whitespace_pattern"),
            ({"structured_outputs": {"structural_tag": "{}"}}, "invalid structural_tag"),
            ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
            ({"structured_outputs": "json"}, "structured_outputs"),
            ({"guided_choice": []}, None),  # an empty list asks for nothing
            ({"guided_choice": ["a", 1]}, "guided_choice"),
            ({"guided_json": PERSON, "guided_regex": "a"}, "guided_json"),
            ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
            ({"response_format": {"type": "json_object", "schema": {"type": "nonsense"}}},
             "json_schema"),
            ({"response_format": {"type": "json_object", "schema": "x"}}, "schema"),
            ({"grammar": "root ::= ("}, "ebnf"),
            ({"messages": [*ASK_PERSON, {"role": "assistant", "content": "{"}],
              "continue_final_message": True, "add_generation_prompt": True},
             "add_generation_prompt")):
        r = post(minisgl_server, "/v1/chat/completions", {**chat, **extra})
        if field is None:
            assert r.status_code == 200, r.text
        else:
            assert_error(r, 400, field)


def test_add_generation_prompt_false_renders_the_messages_as_given(client):
    messages = [{"role": "user", "content": "Hi"}]
    default = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    bare = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})
    from tests import reference as ref
    turn = ref.tokenizer()("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    # without it the prompt ends after the user's turn
    assert bare.usage.prompt_tokens == default.usage.prompt_tokens - len(turn)
    cont = client.chat.completions.create(
        model=MODEL, messages=[*messages, {"role": "assistant", "content": "Hello"}],
        max_tokens=1, extra_body={"continue_final_message": True,
                                  "add_generation_prompt": False})
    assert cont.choices[0].finish_reason in ("stop", "length")

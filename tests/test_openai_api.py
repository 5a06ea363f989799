"""The OpenAI-compatible endpoints, driven by the `openai` client against a real server."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import requests
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


MODEL = ""  # the `model` every request names: the served one (set by the `client` fixture)


@pytest.fixture(scope="module")
def client(minisgl_server) -> openai.OpenAI:
    global MODEL
    client = openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="unused",
                           max_retries=0, timeout=120)
    MODEL = client.models.list().data[0].id
    return client


def native(server: Any, body: dict[str, Any]) -> Any:
    r = requests.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models(client, minisgl_server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].object == "model" and models[0].id


def test_completions_non_stream_matches_generate(client, minisgl_server):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    ref = native(minisgl_server, {"text": PROMPT,
                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert choice.text == ref["text"]
    assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completions_stream_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_batch_n_logprobs_seed(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=5,
                                    temperature=1.0, n=2, seed=3, logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two,"], max_tokens=5,
                                      temperature=1.0, n=2, seed=3, logprobs=2)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        # the top 2, and the sampled token where it is not among them (as OpenAI and vLLM)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == pytest.approx(value, abs=1e-6)
        assert all(x <= 0 for x in lp.token_logprobs)
    assert out.usage.completion_tokens == 20


def test_completions_echo_with_logprobs_scores_the_prompt(client, minisgl_server):
    """The loglikelihood request of evaluation harnesses: echo + logprobs (max_tokens 0
    scores the prompt only). Prompt entries equal /generate's input_token_logprobs."""
    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=2, temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    n = scored.usage.prompt_tokens
    assert choice.text == PROMPT and "".join(lp.tokens) == PROMPT
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert all(top[token] == value for token, value, top in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    meta = native(minisgl_server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 0},
                                   "return_logprob": True, "logprob_start_len": 0})["meta_info"]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        lp.token_logprobs, abs=1e-5)  # (None == None under approx)

    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                        logprobs=1, temperature=0, stream=stream)
        chunks = list(out) if stream else [out]
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
                  for t in c.choices[0].logprobs.token_logprobs]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(tokens) == n + 3 and tokens[0] is None and text.startswith(PROMPT)
        assert tokens[1:n] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_logit_bias_forces_and_bans_tokens(minisgl_server, client):
    from tests import reference as ref
    ids = ref.prompt_ids(PROMPT)
    native = requests.post(minisgl_server.url + "/generate", timeout=120, json={
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    top2 = [token for _, token, _ in native["meta_info"]["output_top_logprobs"][0]]
    free = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert free.choices[0].text == ref.tokenizer().decode([top2[0]])
    banned = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                       logit_bias={str(top2[0]): -100})
    assert banned.choices[0].text == ref.tokenizer().decode([top2[1]])  # the runner-up
    forced = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0.7,
                                       logit_bias={"330": 100})
    assert forced.choices[0].text == ref.tokenizer().decode([330] * 3)


def test_completions_stop_string(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    text = free.choices[0].text  # " Paris.\n\nThe answer is: ..."
    stop = text.strip().split()[1]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_chat_non_stream_uses_the_template(client, minisgl_server):
    from transformers import AutoTokenizer

    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    assert out.choices[0].finish_reason in ("length", "stop")
    path = requests.get(minisgl_server.url + "/get_model_info", timeout=30).json()["model_path"]
    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ref = native(minisgl_server, {"input_ids": ids,
                                  "sampling_params": {"max_new_tokens": 10, "temperature": 0}})
    assert message.content == ref["text"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]

    # max_completion_tokens wins over max_tokens
    short = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                           max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_chat_stream(client):
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_n_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                         temperature=0, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].message.content == out.choices[1].message.content  # greedy
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == out.usage.completion_tokens // 2
        assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                                 temperature=0, stream=True, logprobs=True))
    for k in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert "".join(c.delta.content or "" for c in mine) == out.choices[k].message.content
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert len(entries) == len(out.choices[k].logprobs.content)


BAD_OPENAI = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 9000}, "8192"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"1": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"the": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 50}, "logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("/v1/embeddings", {"input": PROMPT}, "--is-embedding"),  # a generation server
    ("/encode", {"text": PROMPT}, "--is-embedding"),
]


@pytest.mark.parametrize("path,body,contains", BAD_OPENAI)
def test_bad_requests(minisgl_server, path, body, contains):
    r = requests.post(minisgl_server.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert contains in error["message"]


def test_generation_server_refuses_embeddings(client, minisgl_server):
    with pytest.raises(openai.BadRequestError, match="--is-embedding"):
        client.embeddings.create(model=MODEL, input=PROMPT)
    info = requests.get(minisgl_server.url + "/model_info", timeout=30).json()
    assert info["is_generation"] is True


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9000)
    assert "8192" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)


# ---- /tokenize and /detokenize (vLLM's shapes, SGLang's list forms) ------------------------

def post(server: Any, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = requests.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def test_tokenize_detokenize_round_trip(minisgl_server):
    from tests.reference import tokenizer
    hf = tokenizer()
    text = "Tokenizers split text: naïve café, 42 emojis 🎉 and\ttabs."
    out = post(minisgl_server, "/tokenize", {"model": MODEL, "prompt": text,
                                             "return_token_strs": True})
    assert out["tokens"] == hf(text)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] == client_context_len(minisgl_server)
    back = post(minisgl_server, "/v1/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert back["prompt"] == back["text"] == text
    many = post(minisgl_server, "/v1/tokenize", {"prompt": [text, "two"]})
    assert many["tokens"][0] == out["tokens"] and many["count"] == [out["count"], 1]
    texts = post(minisgl_server, "/detokenize", {"tokens": many["tokens"]})["text"]
    assert texts == [text, "two"]


def client_context_len(server: Any) -> int:
    return requests.get(server.url + "/get_server_info", timeout=30).json()["context_length"]


def test_tokenize_messages_counts_what_chat_prefills(client, minisgl_server):
    from tests.reference import tokenizer
    out = post(minisgl_server, "/tokenize", {"messages": CHAT})
    expected = tokenizer().apply_chat_template(CHAT, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    assert out["tokens"] == list(expected)
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert answer.usage.prompt_tokens == out["count"]
    text = post(minisgl_server, "/detokenize", {"tokens": out["tokens"],
                                                "skip_special_tokens": False})["text"]
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("path,body,contains", [
    ("/tokenize", {}, "prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt or messages"),
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/detokenize", {"tokens": [[1], ["a"]]}, "tokens"),
])
def test_tokenize_bad_requests(minisgl_server, path, body, contains):
    error = post(minisgl_server, path, body, status=400)["error"]
    assert contains in error["message"]

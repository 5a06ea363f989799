"""What an SGLang user keeps: the whole `/generate` request surface of SGLang 0.5.23 (supported,
inert, refused, unknown), the OpenAI behaviours SGLang's own server tests check, model naming,
--chat-template, --sampling-defaults and the offline LLM's SGLang names. A real server, the
`openai` client, requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from minisgl.protocol.native import INERT_FIELDS, SUPPORTED_FIELDS, UNSUPPORTED_FIELDS
from tests.test_hardening import SHALLOW
from tests.test_server import PROMPT, assert_error, generate, get, post, requests_total, stream

READABLE_NAME = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "system", "content": "You are a helpful AI assistant"},
            {"role": "user", "content": "What is the capital of France? Answer in a few words."}]
PREFILL = [{"role": "user", "content": "Describe Paris as a JSON object with a name."},
           {"role": "assistant", "content": "{\n"}]

# Every GenerateReqInput field of SGLang 0.5.23 at its default (what its clients send).
GENERATE_DEFAULTS: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False,
    "video_config": None, "watermark": None, "token_ids_logprob": None,
    "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "modalities": None, "session_id": None,
    "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "background": False,
    "require_reasoning": False, "max_thinking_tokens": None, "extra_key": None,
    "cache_salt": None, "return_bytes": False, "return_entropy": False,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None, "token_indices_to_pool": None, "kv_hints": None,
    # inert: any value
    "no_logs": True, "conversation_id": "c1", "custom_labels": {"team": "a"},
    "external_trace_header": {"traceparent": "x"}, "received_time": 1.0,
    "routing_key": "k", "priority": 3, "http_worker_ipc": None,
    # supported, at their defaults
    "stream": False, "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,
    "return_text_in_logprobs": False, "log_metrics": True, "return_prompt_token_ids": False,
    "rid": None,
}
SAMPLING_DEFAULTS = {"stop_regex": None, "beam_width": None, "json_schema": None, "regex": None,
                     "ebnf": None, "structural_tag": None, "stream_interval": 4,
                     "custom_params": {"k": 1}, "watermark": None}
ASKS_SOMETHING: dict[str, Any] = {
    "image_data": ["http://x/y.png"], "lora_path": "adapter", "return_hidden_states": True,
    "return_routed_experts": True, "session_params": {"id": "s"}, "cache_salt": "tenant-a",
    "token_ids_logprob": [1, 2], "custom_logit_processor": "{}", "data_parallel_rank": 1,
    "input_embeds": [[0.0]], "bootstrap_host": "h", "max_thinking_tokens": 10}
SAMPLING_ASKS_SOMETHING = {"beam_width": 2, "watermark": {"key": 1}}


def test_field_tables_cover_sglang_without_overlap():
    assert SUPPORTED_FIELDS.isdisjoint(INERT_FIELDS | UNSUPPORTED_FIELDS)
    assert INERT_FIELDS.isdisjoint(UNSUPPORTED_FIELDS)
    assert set(GENERATE_DEFAULTS) <= SUPPORTED_FIELDS | INERT_FIELDS | UNSUPPORTED_FIELDS


def test_every_sglang_field_at_its_default_is_accepted(minisgl_server):
    greedy = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}})
    out = generate(minisgl_server, {"text": PROMPT, **GENERATE_DEFAULTS, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, **SAMPLING_DEFAULTS}})
    assert out["output_ids"] == greedy["output_ids"]  # and none of them changed anything


@pytest.mark.parametrize("field", sorted(ASKS_SOMETHING))
def test_a_feature_minisgl_lacks_is_refused_by_name(minisgl_server, field):
    before = requests_total(minisgl_server)
    error = assert_error(post(minisgl_server, "/generate", {
        "text": PROMPT, field: ASKS_SOMETHING[field]}), 400)
    assert field in error["message"]
    assert requests_total(minisgl_server) == before


@pytest.mark.parametrize("field", sorted(SAMPLING_ASKS_SOMETHING))
def test_a_sampling_feature_minisgl_lacks_is_refused_by_name(minisgl_server, field):
    error = assert_error(post(minisgl_server, "/generate", {
        "text": PROMPT, "sampling_params": {field: SAMPLING_ASKS_SOMETHING[field]}}), 400)
    assert field in error["message"]


def test_unknown_fields_are_ignored_and_logged_once(minisgl_server):
    logged = len(minisgl_server.stderr)
    for _ in range(2):
        out = generate(minisgl_server, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                        "from_a_future_release": 1, "model": None})
        assert len(out["output_ids"]) == 2
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})):
        for _ in range(2):
            r = post(minisgl_server, path, {**body, "from_a_future_release": 1})
            assert r.status_code == 200, r.text
    log = "".join(minisgl_server.stderr[logged:])
    assert log.count("ignoring unknown field(s) from_a_future_release") == 3, log
    # inside sampling_params a misspelt name is an error, as in SGLang
    assert "max_tokens" in assert_error(post(minisgl_server, "/generate", {
        "text": PROMPT, "sampling_params": {"max_tokens": 5}}), 400)["message"]


def test_native_details_as_sglang(minisgl_server):
    both = generate(minisgl_server, {"text": PROMPT, "input_ids": [1, 2, 3],
                                     "sampling_params": {"max_new_tokens": 2}})
    assert both["meta_info"]["prompt_tokens"] == 5  # text wins over input_ids
    batch = generate(minisgl_server, {"text": [PROMPT, "Hello"], "rid": "grp",
                                      "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in batch] == ["grp_0", "grp_1"]
    ids = generate(minisgl_server, {"input_ids": [1, 2, 3], "return_prompt_token_ids": True,
                                    "sampling_params": {"max_new_tokens": 1}})
    assert ids["prompt_token_ids"] == [1, 2, 3]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_stop_token_that_ends_a_request_is_trimmed_from_its_text(minisgl_server,
                                                                      skip_special_tokens):
    """As SGLang: the stop token (here the greedy answer's second token, made one by
    stop_token_ids) stays in output_ids, and its text leaves the text unless no_stop_trim;
    with skip_special_tokens false an end-of-turn token would show otherwise."""
    first = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 2}})
    token = first["output_ids"][1]
    params = {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [token],
              "skip_special_tokens": skip_special_tokens}
    trimmed = generate(minisgl_server, {"text": PROMPT, "sampling_params": params})
    kept = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        **params, "no_stop_trim": True}})
    assert trimmed["output_ids"] == kept["output_ids"] == first["output_ids"]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert kept["text"] == first["text"] and kept["text"].startswith(trimmed["text"])
    assert len(trimmed["text"]) < len(kept["text"])


def test_max_new_tokens_null_fills_the_context(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, "--context-length", "48")
    out = generate(server, {"input_ids": list(range(10, 30)), "sampling_params": {
        "max_new_tokens": None, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 48 - 20
    assert out["meta_info"]["finish_reason"]["type"] == "length"


# ---- OpenAI behaviours -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(minisgl_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def test_models_carry_a_readable_name(client, minisgl_server):
    [card] = client.models.list().data
    assert card.id == card.root == READABLE_NAME and isinstance(card.max_model_len, int)
    assert client.models.retrieve(READABLE_NAME).id == READABLE_NAME
    path = get(minisgl_server, "/get_model_info").json()["model_path"]
    assert client.models.retrieve(path).root == path  # the path names the model too
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("non-existent-model")
    r = get(minisgl_server, "/v1/models/non-existent-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert get(minisgl_server, "/get_model_info").json()["served_model_name"] == READABLE_NAME
    assert get(minisgl_server, "/server_info").json()["served_model_name"] == READABLE_NAME
    assert f'model_name="{READABLE_NAME}"' in get(minisgl_server, "/metrics").text
    out = client.completions.create(model=READABLE_NAME, prompt=PROMPT, max_tokens=1)
    assert out.model == READABLE_NAME


@pytest.mark.parametrize("chat", [False, True])
def test_stream_usage_and_finish_reasons(client, chat):
    kw: dict[str, Any] = {"model": READABLE_NAME, "max_tokens": 5, "temperature": 0,
                          "stream": True, "n": 2, "extra_body": {"ignore_eos": True},
                          "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}}
    chunks = list(client.chat.completions.create(messages=MESSAGES, **kw) if chat
                  else client.completions.create(prompt=PROMPT, **kw))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10  # both choices
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in content:
        choice = chunk.choices[0]
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
        if chunk.usage is not None:  # each content chunk: its choice's usage so far
            assert 0 <= chunk.usage.completion_tokens <= 5
    assert finishes == {0: ["length"], 1: ["length"]}  # exactly one, and "length"


def test_n_samples_are_independent(client):
    out = client.completions.create(model=READABLE_NAME, prompt="Once upon a time",
                                    max_tokens=12, temperature=1.0, n=4)
    assert len({c.text for c in out.choices}) > 1
    seeded = [client.completions.create(model=READABLE_NAME, prompt="Once upon a time",
                                        max_tokens=12, temperature=1.0, n=3, seed=7)
              for _ in range(2)]
    texts = [[c.text for c in s.choices] for s in seeded]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1  # reproducible, yet distinct


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_as_clients_index_it(client, stream):
    """SGLang's own server test checks these: the prompt's tokens first, the first one
    unscored; a dict of top logprobs for every later position."""
    kw = {"model": READABLE_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
          "echo": True, "logprobs": 3}
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        first = chunks[0].choices[0]
        assert first.text.startswith(PROMPT)
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
        tops = [t for c in chunks for t in c.choices[0].logprobs.top_logprobs]
    else:
        choice = client.completions.create(**kw).choices[0]
        assert choice.text.startswith(PROMPT)
        tokens, values = choice.logprobs.tokens, choice.logprobs.token_logprobs
        tops = choice.logprobs.top_logprobs
    prompt_tokens = 5
    assert len(tokens) == len(values) == len(tops) == prompt_tokens + 4
    assert "".join(tokens[:prompt_tokens]) == PROMPT
    assert values[0] is None and tops[0] is None
    assert all(isinstance(v, float) for v in values[1:])
    assert all(isinstance(t, dict) and t for t in tops[1:])


def test_assistant_prefill_continues_the_last_message(client, minisgl_server):
    """continue_final_message: the template ends in the assistant's turn, then the prefix; the
    answer continues it and does not repeat it. Checked against /generate on those ids."""
    from transformers import AutoTokenizer
    path = get(minisgl_server, "/get_model_info").json()["tokenizer_path"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(PREFILL[:1], add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"] + tok(
        "{\n", add_special_tokens=False)["input_ids"]
    expected = generate(minisgl_server, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0}})
    out = client.chat.completions.create(model=READABLE_NAME, messages=PREFILL, max_tokens=12,
                                         temperature=0,
                                         extra_body={"continue_final_message": True})
    assert out.choices[0].message.content == expected["text"]
    assert out.usage.prompt_tokens == len(ids)
    # without the flag a trailing assistant message is sent as a user turn (as SGLang)
    as_user = [PREFILL[0], {"role": "user", "content": "{\n"}]
    plain = client.chat.completions.create(model=READABLE_NAME, messages=PREFILL, max_tokens=8,
                                           temperature=0)
    user = client.chat.completions.create(model=READABLE_NAME, messages=as_user, max_tokens=8,
                                          temperature=0)
    assert plain.choices[0].message.content == user.choices[0].message.content


def test_content_parts_user_and_seed(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]
    out = client.chat.completions.create(model=READABLE_NAME, messages=parts, max_tokens=4,
                                         temperature=0.7, seed=3, user="alice")
    again = client.chat.completions.create(model=READABLE_NAME, messages=parts, max_tokens=4,
                                           temperature=0.7, seed=3, user="bob")
    assert out.choices[0].message.content == again.choices[0].message.content


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ greeting | default('') }}"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_template_flag_kwargs_and_served_name(minisgl_server_factory, tmp_path: Path):
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    for flag, names in ((str(template), ["my-model"]),  # a file, or the template itself
                        (TEMPLATE, ["my-model", "alias", "--strict-model-name"])):
        server = minisgl_server_factory(*SHALLOW, "--chat-template", flag,
                                        "--served-model-name", *names)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        strict = "--strict-model-name" in names
        served = [n for n in names if not n.startswith("--")]
        assert [m.id for m in client.models.list().data] == served
        for model in ("gpt-4o", *served):
            if strict and model not in served:
                with pytest.raises(openai.NotFoundError, match="does not exist"):
                    client.completions.create(model=model, prompt="Hi", max_tokens=1)
                continue
            out = client.completions.create(model=model, prompt="Hi", max_tokens=1)
            assert out.model == "my-model"  # the first served name, whichever was asked for
            chunks = list(client.chat.completions.create(
                model=model, messages=MESSAGES[1:], max_tokens=2, stream=True))
            assert chunks and {c.model for c in chunks} == {"my-model"}
        assert 'model_name="my-model"' in requests.get(server.url + "/metrics", timeout=30).text
        assert 'model_name="alias"' not in requests.get(server.url + "/metrics", timeout=30).text
        base = client.chat.completions.create(model="my-model", messages=MESSAGES[1:],
                                              max_tokens=1)
        greeted = client.chat.completions.create(
            model="my-model", messages=MESSAGES[1:], max_tokens=1,
            extra_body={"chat_template_kwargs": {"greeting": "Hello hello hello. "}})
        assert greeted.usage.prompt_tokens > base.usage.prompt_tokens
        r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
        assert_error(r, 400, "chat_template")
        server.stop()


# a template without a system role, as Gemma's: it raises on one
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_without_a_system_role_gets_it_folded(minisgl_server_factory):
    """Gemma 2's template refuses a system message: it is folded into the first user turn
    (its text, a blank line, the user's), as Gemma 3's template does itself."""
    server = minisgl_server_factory(*SHALLOW, "--chat-template", NO_SYSTEM_TEMPLATE)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    system = [{"role": "system", "content": "Answer in French."},
              {"role": "user", "content": "Name a color."}]
    folded = [{"role": "user", "content": "Answer in French.\n\nName a color."}]
    outs = [client.chat.completions.create(model="m", messages=m, max_tokens=6, temperature=0)
            for m in (system, folded)]
    assert outs[0].usage.prompt_tokens == outs[1].usage.prompt_tokens
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "system", "content": "x"}]})  # nothing to fold it into
    assert_error(r, 400, "System role not supported")
    server.stop()


def test_sampling_defaults_from_generation_config(minisgl_server_factory, tmp_path: Path,
                                                   minisgl_server):
    """--sampling-defaults model (SGLang's default): chat requests that leave the sampling
    fields out take the model's generation_config.json (here: greedy); openai: do not. Its
    eos_token_id list stops generation either way, beside config.json's."""
    source = Path(get(minisgl_server, "/get_model_info").json()["model_path"])
    model = tmp_path / "model"
    model.mkdir()
    for file in source.iterdir():
        (model / file.name).symlink_to(file)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                              "top_p": 0.9,
                                                              "eos_token_id": [2, 42]}))
    for policy, distinct in (("model", 1), ("openai", 2)):
        server = minisgl_server_factory(*SHALLOW, "--model", str(model),
                                        "--sampling-defaults", policy)
        r = requests.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 8, "n": 4})
        texts = {c["message"]["content"] for c in r.json()["choices"]}
        assert (len(texts) == 1) == (distinct == 1), (policy, texts)
        forced = requests.post(server.url + "/generate", timeout=60, json={
            "text": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                "logit_bias": {"42": 100}}}).json()
        assert forced["meta_info"]["finish_reason"] == {"type": "stop", "matched": 42}
        assert forced["meta_info"]["completion_tokens"] == 1
        server.stop()


def test_sglang_native_stream_shape(minisgl_server):
    """What sglang.bench_serving reads of every chunk: cumulative text and completion_tokens."""
    chunks = stream(minisgl_server, {"text": PROMPT, "return_routed_experts": False,
                                     "lora_path": None, "logprob_start_len": -1,
                                     "sampling_params": {"max_new_tokens": 6,
                                                         "temperature": 0.0,
                                                         "ignore_eos": True}})
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert [c["meta_info"]["completion_tokens"] for c in chunks][-1] == 6


# ---- the offline LLM takes the same names ------------------------------------------------------

def test_llm_takes_generate_fields():
    from minisgl import LLM
    from minisgl.errors import InvalidRequest

    with LLM(dtype="float32", load_format="dummy",
             json_model_override_args='{"num_hidden_layers": 2}') as llm:
        out = llm.generate(prompt="Hello", sampling_params={"max_new_tokens": 2},
                           rid="mine", return_prompt_token_ids=True, return_logprob=True,
                           top_logprobs_num=2, return_text_in_logprobs=True,
                           lora_path=None, return_hidden_states=False)
        assert out["meta_info"]["id"] == "mine" and out["prompt_token_ids"]
        assert all(isinstance(e[2], str) for e in out["meta_info"]["output_token_logprobs"])
        many = llm.generate(prompt=["a", "b"], sampling_params={"max_new_tokens": 1, "n": 2})
        assert len(many) == 4
        with pytest.raises(InvalidRequest, match="lora_path"):
            llm.generate(prompt="Hello", lora_path="adapter")
        with pytest.raises(TypeError, match="not_a_field"):
            llm.generate(prompt="Hello", not_a_field=1)
        with pytest.raises(InvalidRequest, match="stream"):
            llm.generate(prompt="Hello", stream=True)

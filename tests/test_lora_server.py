"""Multi-LoRA over HTTP: a real server (the bundled SmolLM2 cut to 4 layers, float32) with
random PEFT adapters made here; SGLang's lora_path and adapter endpoints, the openai client with
`model="base:adapter"` and the adapter's name alone, /v1/models, adapters loaded and unloaded
while requests stream, and bad input."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.conftest import start_minisgl_server
from tests.lora_fixtures import assert_lora_greedy, merged_greedy, save_adapter
from tests.reference import model_folder, prompt_ids
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

LAYERS = 4
PROMPT = "The capital of France is"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smol-lora")
    base = model_folder()
    return {"sql": save_adapter(base, root / "sql", seed=11, rank=16, layers=LAYERS,
                                b_scale=8.0),
            "chat": save_adapter(base, root / "chat", seed=12, rank=8, layers=LAYERS,
                                 targets=["q_proj", "v_proj", "down_proj"], b_scale=8.0)}


@pytest.fixture(scope="module")
def server(adapters):
    srv = start_minisgl_server(
        "--json-model-override-args", json.dumps({"num_hidden_layers": LAYERS}),
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all",
        "--max-loras-per-batch", "2", "--lora-paths", f"sql={adapters['sql']}")
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()


def generate(server, lora_path, text=PROMPT, max_new_tokens=NEW_TOKENS, **extra):
    return requests.post(server.url + "/generate", json={
        "text": text, "lora_path": lora_path, **extra,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                            "ignore_eos": True}}, timeout=120)


def reference(adapter: Path | None) -> list[int]:
    return merged_greedy(model_folder(), adapter, [prompt_ids(PROMPT)], NEW_TOKENS, LAYERS)[0]


def test_generate_with_adapters_matches_peft(server, adapters) -> None:
    models = requests.get(server.url + "/v1/models", timeout=10).json()["data"]
    base_name = models[0]["id"]
    assert {"id": "sql", "root": str(adapters["sql"]), "parent": base_name}.items() <= \
        models[-1].items()
    for name, adapter in ((None, None), ("sql", adapters["sql"])):
        out = generate(server, name).json()
        assert_lora_greedy(model_folder(), adapter, prompt_ids(PROMPT), out["output_ids"],
                           reference(adapter), LAYERS)
    batch = requests.post(server.url + "/generate", json={
        "text": [PROMPT, PROMPT], "lora_path": ["sql", None],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                            "ignore_eos": True}}, timeout=120).json()
    assert [r["output_ids"] for r in batch] == [generate(server, "sql").json()["output_ids"],
                                                generate(server, None).json()["output_ids"]]
    assert batch[0]["output_ids"] != batch[1]["output_ids"]


def test_openai_client_names_the_adapter(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    base_name = client.models.list().data[0].id
    expected = generate(server, "sql").json()["text"]
    for model in (f"{base_name}:sql", "sql"):
        answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert answer.choices[0].text == expected and answer.model == model
    chat = [{"role": "user", "content": "Name a color."}]
    with_adapter = client.chat.completions.create(model="sql", messages=chat, max_tokens=8,
                                                  temperature=0)
    plain = client.chat.completions.create(model=base_name, messages=chat, max_tokens=8,
                                           temperature=0)
    assert with_adapter.model == "sql"
    assert with_adapter.choices[0].message.content != plain.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter `nope`"):
        client.completions.create(model=f"{base_name}:nope", prompt=PROMPT, max_tokens=2)


def stream_tokens(server, lora_path, max_new_tokens, done: dict) -> None:
    with requests.post(server.url + "/generate", stream=True, timeout=120, json={
            "text": PROMPT, "lora_path": lora_path, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "ignore_eos": True}}) as response:
        done["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                done["last"] = json.loads(line[6:])
    done["at"] = time.monotonic()


def test_load_and_unload_while_requests_stream(server, adapters) -> None:
    url = server.url
    base_stream: dict = {}
    runner = threading.Thread(target=stream_tokens, args=(server, None, 200, base_stream))
    runner.start()
    loaded = requests.post(url + "/load_lora_adapter", json={
        "lora_name": "chat", "lora_path": str(adapters["chat"])}, timeout=60).json()
    assert loaded["success"] and loaded["loaded_adapters"] == {
        "sql": str(adapters["sql"]), "chat": str(adapters["chat"])}
    out = generate(server, "chat").json()
    assert_lora_greedy(model_folder(), adapters["chat"], prompt_ids(PROMPT), out["output_ids"],
                       reference(adapters["chat"]), LAYERS)
    # an unload waits for the adapter's request in flight, which ends whole
    adapter_stream: dict = {}
    streaming = threading.Thread(target=stream_tokens, args=(server, "chat", 120,
                                                             adapter_stream))
    streaming.start()
    time.sleep(0.5)
    unloaded = requests.post(url + "/unload_lora_adapter", json={"lora_name": "chat"},
                             timeout=120)
    unloaded_at = time.monotonic()
    streaming.join()
    runner.join()
    assert unloaded.json() == {"success": True, "error_message": "",
                               "loaded_adapters": {"sql": str(adapters["sql"])}}
    assert adapter_stream["at"] <= unloaded_at + 0.5
    assert adapter_stream["last"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(adapter_stream["last"]["output_ids"]) == 120
    assert base_stream["last"]["meta_info"]["finish_reason"]["type"] == "length"
    refused = generate(server, "chat")
    assert refused.status_code == 400 and "unknown LoRA adapter 'chat'" in refused.text
    assert "chat" not in [m["id"] for m in requests.get(url + "/v1/models", timeout=10)
                          .json()["data"]]


def test_bad_adapter_requests_get_clear_errors(server, adapters, tmp_path) -> None:
    url = server.url
    empty = adapters["sql"].parent / "not-an-adapter"  # beside --lora-paths': allowed
    empty.mkdir(exist_ok=True)
    for body, says in (({"lora_path": "x"}, "lora_name"), ({"lora_name": "x"}, "lora_path"),
                       ({"lora_name": "x", "lora_path": str(empty)}, "not a PEFT adapter"),
                       ({"lora_name": "sql", "lora_path": str(empty)}, "already loaded")):
        answer = requests.post(url + "/load_lora_adapter", json=body, timeout=30)
        assert answer.status_code == 400 and says in answer.text, answer.text
    # anywhere else on the server's disk, by name or by a way out of the allowed folder
    for outside in (tmp_path, adapters["sql"].parent / ".." / tmp_path.name, "/etc"):
        answer = requests.post(url + "/load_lora_adapter", json={
            "lora_name": "x", "lora_path": str(outside)}, timeout=30)
        assert answer.status_code == 403, answer.text
        assert "--lora-dirs" in answer.json()["error"]["message"]
    answer = requests.post(url + "/unload_lora_adapter", json={"lora_name": "zzz"}, timeout=30)
    assert answer.status_code == 400 and answer.json()["success"] is False
    for lora_path, says in (("zzz", "unknown LoRA adapter"), (3, "lora_path must be")):
        answer = generate(server, lora_path)
        assert answer.status_code == 400 and says in answer.json()["error"]["message"]
    assert generate(server, "sql").status_code == 200

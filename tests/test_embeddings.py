"""Embeddings (--is-embedding) with the real `openai` client and SGLang's /encode, against
transformers' last hidden state (the base model's, after its final norm) at the last token,
L2-normalised, in float32.

One embedding server, with small prefill chunks (inputs longer than a chunk are prefilled in
several) and --strict-model-name. Measured on the bundled SmolLM2 in float32: max abs
difference to the reference ~1.5e-6 (cosine 1 - 2e-7), batch against solo and cached against
uncached ~1e-6; the bounds below leave two orders of magnitude for other BLAS paths.
"""

from __future__ import annotations

import base64
import functools

import numpy as np
import openai
import pytest
import requests
import torch

from tests import reference as ref
from tests.conftest import start_minisgl_server
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

MAX_ABS_DIFF = 1e-4  # against transformers
MIN_COSINE = 0.99999
SAME_BOUND = 1e-5  # the same input embedded in another batch, chunking or from the cache
CHUNK = 32  # --chunked-prefill-size: LONG spans several chunks
LONG = " ".join(f"item {i}," for i in range(40))  # ~120 tokens
INPUTS = [*ref.PLAIN_PROMPTS, LONG]
HIDDEN = 576  # SmolLM2-135M


@pytest.fixture(scope="module")
def server():
    server = start_minisgl_server("--is-embedding", "--chunked-prefill-size", str(CHUNK),
                                  "--strict-model-name")
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@functools.lru_cache(maxsize=1)
def base_model() -> torch.nn.Module:
    """transformers' base model (no LM head): its last_hidden_state is after the final norm."""
    from transformers import AutoModel
    return AutoModel.from_pretrained(ref.model_folder(), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def hf_embedding(ids: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        last = base_model()(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(last, dim=-1)


def assert_matches_reference(ours: list[float] | np.ndarray, ids: list[int]) -> None:
    got = torch.tensor(np.asarray(ours, dtype=np.float32))
    want = hf_embedding(tuple(ids))
    assert got.shape == (HIDDEN,)
    assert abs(got.norm().item() - 1) < 1e-5
    diff = (got - want).abs().max().item()
    cosine = torch.dot(got, want).item()
    assert diff <= MAX_ABS_DIFF and cosine >= MIN_COSINE, (diff, cosine)


def assert_same(a: list[float] | np.ndarray, b: list[float] | np.ndarray) -> None:
    diff = np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()
    assert diff <= SAME_BOUND, diff


def post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=120)


def test_model_info_and_models(server, client, model):
    info = requests.get(server.url + "/model_info", timeout=30).json()
    assert info["is_generation"] is False
    assert [m.id for m in client.models.list().data] == [model]


def test_string_matches_transformers(client, model):
    out = client.embeddings.create(model=model, input=ref.PLAIN_PROMPTS[0],
                                   encoding_format="float")
    assert out.object == "list" and out.model == model and len(out.data) == 1
    item = out.data[0]
    assert item.object == "embedding" and item.index == 0
    ids = ref.prompt_ids(ref.PLAIN_PROMPTS[0])
    assert_matches_reference(item.embedding, ids)
    assert out.usage.prompt_tokens == out.usage.total_tokens == len(ids)


def test_list_matches_transformers_and_each_alone(client, model):
    """A batch (LONG prefilled in chunks beside the short ones) equals each input alone."""
    out = client.embeddings.create(model=model, input=INPUTS, encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(INPUTS)))
    ids = [ref.prompt_ids(text) for text in INPUTS]
    assert len(ids[-1]) > 2 * CHUNK
    assert out.usage.prompt_tokens == sum(map(len, ids))
    for item, prompt in zip(out.data, ids):
        assert_matches_reference(item.embedding, prompt)
    for item, text in zip(out.data, INPUTS):
        alone = client.embeddings.create(model=model, input=text, encoding_format="float")
        assert_same(item.embedding, alone.data[0].embedding)


def test_token_ids_equal_text(client, model):
    ids = [ref.prompt_ids(text) for text in ref.PLAIN_PROMPTS[:2]]
    text = client.embeddings.create(model=model, input=ref.PLAIN_PROMPTS[:2],
                                    encoding_format="float")
    one = client.embeddings.create(model=model, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert len(one.data) == 1 and len(many.data) == 2
    assert_same(one.data[0].embedding, text.data[0].embedding)
    for a, b, prompt in zip(many.data, text.data, ids):
        assert_same(a.embedding, b.embedding)
        assert_matches_reference(a.embedding, prompt)


def test_base64(client, model):
    """Explicit base64 comes back as the string (float32 little-endian); the client's default
    also asks for base64 and decodes it itself."""
    text = ref.PLAIN_PROMPTS[1]
    floats = client.embeddings.create(model=model, input=text, encoding_format="float")
    raw = client.embeddings.create(model=model, input=text, encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert_same(vector, floats.data[0].embedding)
    assert_matches_reference(vector, ref.prompt_ids(text))
    default = client.embeddings.create(model=model, input=text)
    assert_same(default.data[0].embedding, floats.data[0].embedding)


def test_dimensions_equal_to_hidden_size_accepted(client, model):
    out = client.embeddings.create(model=model, input="hello", dimensions=HIDDEN,
                                   encoding_format="float", user="someone")
    assert len(out.data[0].embedding) == HIDDEN


def test_encode_native(server):
    text = ref.PLAIN_PROMPTS[2]
    one = post(server, "/encode", {"text": text}).json()
    assert set(one) == {"embedding", "meta_info"}
    meta = one["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["prompt_tokens"] == len(ref.prompt_ids(text)) and meta["id"]
    assert_matches_reference(one["embedding"], ref.prompt_ids(text))
    batch = post(server, "/encode", {"text": [text, ref.PLAIN_PROMPTS[3]], "rid": "b"}).json()
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
    assert_same(batch[0]["embedding"], one["embedding"])
    by_ids = post(server, "/encode", {"input_ids": ref.prompt_ids(text)}).json()
    assert_same(by_ids["embedding"], one["embedding"])
    lists = post(server, "/encode", {"input_ids": [ref.prompt_ids(text)]}).json()
    assert isinstance(lists, list) and len(lists) == 1


def test_full_prefix_hit_recomputes_the_last_token(server):
    """The second time, every page but the last token's comes from the prefix cache."""
    first = post(server, "/encode", {"text": LONG}).json()
    again = post(server, "/encode", {"text": LONG}).json()
    prompt = ref.prompt_ids(LONG)
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - 16  # a page at most
    assert again["meta_info"]["cached_tokens"] < len(prompt)
    assert_same(again["embedding"], first["embedding"])
    assert_matches_reference(again["embedding"], prompt)


@pytest.mark.parametrize("path,body,contains", [
    ("/v1/embeddings", {"input": "x", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": "big"}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": ""}, "input is empty"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input[1] is empty"),
    ("/v1/embeddings", {"input": []}, "input must be"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input[1] is empty"),
    ("/v1/embeddings", {"input": [1, 10**9]}, "input must hold token ids"),
    ("/v1/embeddings", {"input": {"text": "x"}}, "input must be"),
    ("/v1/embeddings", {}, "give input"),
    ("/v1/embeddings", {"input": "x", "user": 3}, "user"),
    ("/v1/embeddings", {"input": "x " * 9000}, "context length"),
    ("/encode", {}, "give text or input_ids"),
    ("/encode", {"text": 5}, "text must be"),
    ("/encode", {"input_ids": ["a"]}, "input_ids must be"),
    ("/encode", {"text": "x", "dimensions": 1}, "dimensions"),
    ("/encode", {"text": "x", "image_data": "http://x/y.png"}, "image_data"),
    ("/generate", {"text": "x"}, "--is-embedding"),
    ("/v1/completions", {"prompt": "x"}, "--is-embedding"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
     "--is-embedding"),
    ("/v1/responses", {"input": "x"}, "--is-embedding"),
])
def test_bad_requests(server, path, body, contains):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert contains in r.json()["error"]["message"], r.text


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_openai_client_sees_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=8)


def test_tp3_matches_transformers():
    """Tensor parallelism: the final hidden state is whole on rank 0 (the row-parallel
    layers all-reduce), so its embeddings equal tp 1's within float rounding."""
    from minisgl import LLM
    with LLM(dtype="float32", tp_size=3, is_embedding=True, max_total_tokens=2048,
             max_running_requests=4, chunked_prefill_size=CHUNK) as llm:
        out = llm.encode(INPUTS)
        llm.check_integrity()
    for item, text in zip(out, INPUTS):
        assert_matches_reference(item["embedding"], ref.prompt_ids(text))


def test_is_embedding_refuses_speculation():
    from minisgl.args import ServerArgs
    with pytest.raises(ValueError, match="--is-embedding"):
        ServerArgs(is_embedding=True, speculative_algorithm="NGRAM")

"""The HTTP server end to end: a real `python -m minisgl serve` with the SmolLM2 weights, real
HTTP clients (requests, curl, http.client), no mocks."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable
from urllib.parse import urlsplit

import psutil
import requests

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_new_tokens": 12}
EMOJI_PROMPT = "😀😃😄😁😆😅😂🤣😊"  # greedy SmolLM2 answers with more emoji
CJK_PROMPT = "我喜欢吃苹果。我喜欢吃"  # ... and with Chinese characters


# ---- helpers -----------------------------------------------------------------------------------

def post(server: Any, path: str, body: Any = None, data: bytes | None = None,
         **kw: Any) -> requests.Response:
    return requests.post(server.url + path, json=body, data=data, timeout=120, **kw)


def get(server: Any, path: str, **kw: Any) -> requests.Response:
    return requests.get(server.url + path, timeout=60, **kw)


def state(server: Any) -> dict[str, Any]:
    return get(server, "/get_server_info").json()["internal_states"][0]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")


def parse_sse(raw: bytes) -> list[Any]:
    """Strictly `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == ""
    out = []
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        payload = event[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]


def generate(server: Any, body: dict[str, Any]) -> Any:
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Any, body: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    r = post(server, "/generate", {**body, "stream": True}, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    return parse_sse(r.content)


def flush(server: Any) -> None:
    wait_for(lambda: post(server, "/flush_cache").status_code == 200, what="/flush_cache 200")


def assert_idle_and_freed(server: Any) -> None:
    """No request runs, every KV page is free or in the prefix cache, and after a flush the
    pool is empty."""
    wait_for(lambda: state(server)["num_running_reqs"] == 0 and
             state(server)["num_waiting_reqs"] == 0, what="no running requests")
    s = wait_for(lambda: (lambda s: s if s["kv_used_tokens"] == s["kv_cached_tokens"] else None)(
        state(server)), what="no KV owned by requests")
    assert s["integrity_error"] is None
    flush(server)
    assert state(server)["kv_used_tokens"] == 0


def requests_total(server: Any) -> int:
    for line in get(server, "/metrics").text.splitlines():
        if line.startswith("minisgl_requests_total{"):
            return int(float(line.split()[1]))
    raise AssertionError("minisgl_requests_total missing")


def assert_error(r: requests.Response, status: int, contains: str = "") -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["Content-Type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == status
    assert contains in error["message"], error
    return error


# ---- operations ------------------------------------------------------------------------------

def test_health_and_info_endpoints(minisgl_server):
    r = get(minisgl_server, "/health")
    assert r.status_code == 200
    assert post(minisgl_server, "/health").status_code == 200

    info = get(minisgl_server, "/get_model_info").json()
    assert info["is_generation"] is True
    from pathlib import Path
    assert (Path(info["model_path"]) / "config.json").is_file()
    assert (Path(info["tokenizer_path"]) / "tokenizer.json").is_file()

    server_info = get(minisgl_server, "/get_server_info").json()
    assert server_info["dtype"] == "float32" and server_info["max_total_tokens"] == 20000
    assert server_info["max_running_requests"] == 32 and server_info["version"]
    states = server_info["internal_states"]
    assert isinstance(states, list) and len(states) == 1
    assert states[0]["kv_pool_tokens"] == 20000
    assert {"num_running_reqs", "num_waiting_reqs", "kv_used_tokens"} <= set(states[0])
    # the configuration as resolved, in sections, and printed at start as one block
    resolved = server_info["resolved"]
    assert set(resolved) == {"model", "engine", "scheduler", "server"}
    assert resolved["model"]["dtype"] == "float32" and resolved["engine"]["device"] == "cpu"
    assert resolved["engine"]["kv_pool_tokens"] == 20000
    assert resolved["engine"]["max_running_requests"] == 32
    chunk = resolved["scheduler"]["chunked_prefill_size"]
    assert isinstance(chunk, int) and chunk == server_info["chunked_prefill_size"]
    log = "".join(minisgl_server.stderr)
    assert "running with:" in log and f"scheduler.chunked_prefill_size = {chunk}" in log

    r = get(minisgl_server, "/health_generate")
    assert r.status_code == 200, r.text

    models = get(minisgl_server, "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"

    assert_error(get(minisgl_server, "/no_such_endpoint"), 404)
    assert_error(get(minisgl_server, "/generate"), 405)


def test_metrics_prometheus_text(minisgl_server):
    before = requests_total(minisgl_server)
    steps_before = state(minisgl_server)["engine_decode_steps"]
    generate(minisgl_server, {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 2}})
    after = state(minisgl_server)
    assert after["engine_decode_steps"] > steps_before and after["engine_decode_seconds"] > 0
    r = get(minisgl_server, "/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    text = r.text
    for name in ("sglang:num_running_reqs", "sglang:token_usage", "sglang:generation_tokens_total",
                 "sglang:time_to_first_token_seconds_bucket", "sglang:e2e_request_latency_"
                 "seconds_count", "minisgl_engine_decode_seconds_total"):
        assert f"\n{name}" in text, name
    assert "# TYPE minisgl_requests_total counter" in text
    assert requests_total(minisgl_server) == before + 1


def test_flush_cache_and_abort_request(minisgl_server):
    flush(minisgl_server)
    assert state(minisgl_server)["kv_used_tokens"] == 0
    long = {"text": PROMPT, "rid": "long-one",
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}}
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(stream, minisgl_server, long)
        two = pool.submit(generate, minisgl_server, {**long, "rid": "long-two"})
        wait_for(lambda: state(minisgl_server)["num_running_reqs"] == 2, what="2 running")
        assert_error(post(minisgl_server, "/flush_cache"), 400, "running")
        r = post(minisgl_server, "/abort_request", {"rid": "long-one"})
        assert r.status_code == 200 and r.json()["success"] is True
        chunks = one.result(timeout=60)
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert chunks[-1]["meta_info"]["completion_tokens"] < 4000
        r = post(minisgl_server, "/abort_request", {"abort_all": True})
        assert r.status_code == 200 and r.json()["aborted"] == ["long-two"]
        result = two.result(timeout=60)
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(minisgl_server, "/abort_request", {"rid": "no-such"}).json()["success"] is False
    assert_error(post(minisgl_server, "/abort_request", {"rid": 5}), 400)
    assert_idle_and_freed(minisgl_server)


# ---- /generate -------------------------------------------------------------------------------

def test_generate_plain_with_curl(minisgl_server):
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "ignore_eos": True}}
    out = subprocess.run(["curl", "-sS", "--fail-with-body", minisgl_server.url + "/generate",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, check=True, timeout=60).stdout
    result = json.loads(out)
    assert set(result) == {"text", "output_ids", "meta_info"}
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["completion_tokens"] == len(result["output_ids"]) == 12
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and isinstance(meta["id"], str)
    assert result["text"].strip()


def test_stream_with_curl_is_cumulative_and_matches_non_stream(minisgl_server):
    body = {"text": PROMPT, "sampling_params": GREEDY}
    flush(minisgl_server)
    out = subprocess.run(["curl", "-sS", "-N", "--fail-with-body", minisgl_server.url + "/generate",
                          "-H", "Content-Type: application/json",
                          "-d", json.dumps({**body, "stream": True})],
                         capture_output=True, check=True, timeout=60).stdout
    chunks = parse_sse(out)
    assert len(chunks) >= 2
    previous_text, previous_ids = "", []
    for chunk in chunks:
        assert "index" not in chunk
        assert chunk["text"].startswith(previous_text)
        assert chunk["output_ids"][:len(previous_ids)] == previous_ids
        assert chunk["meta_info"]["completion_tokens"] == len(chunk["output_ids"])
        previous_text, previous_ids = chunk["text"], chunk["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    tokens = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert tokens == sorted(set(tokens))  # strictly growing
    flush(minisgl_server)
    whole = generate(minisgl_server, body)
    assert whole["text"] == chunks[-1]["text"]
    assert whole["output_ids"] == chunks[-1]["output_ids"]


def test_stream_utf8_text_never_broken(minisgl_server):
    body = {"text": [EMOJI_PROMPT, CJK_PROMPT],
            "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    chunks = stream(minisgl_server, body)
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        i = chunk["index"]
        assert "\ufffd" not in chunk["text"], chunk
        assert chunk["text"].startswith(texts[i])
        texts[i] = chunk["text"]
    assert any(ord(c) > 0x1F000 for c in texts[0]), texts[0]  # emoji came out
    assert any(0x4E00 <= ord(c) <= 0x9FFF for c in texts[1]), texts[1]  # CJK came out
    whole = generate(minisgl_server, body)
    assert [w["text"] for w in whole] == [texts[0], texts[1]]


def test_batch_and_n(minisgl_server):
    prompts = [PROMPT, "One, two, three,"]
    params = {**GREEDY, "max_new_tokens": 6}
    singles = [generate(minisgl_server, {"text": p, "sampling_params": params}) for p in prompts]
    batch = generate(minisgl_server, {"text": prompts, "sampling_params": params,
                                      "rid": ["b-0", "b-1"]})
    assert isinstance(batch, list) and len(batch) == 2
    assert [b["meta_info"]["id"] for b in batch] == ["b-0", "b-1"]
    assert [b["output_ids"] for b in batch] == [s["output_ids"] for s in singles]
    by_ids = generate(minisgl_server, {
        "input_ids": [batch[0]["output_ids"][:2], [1, 2, 3]],
        "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert [b["meta_info"]["completion_tokens"] for b in by_ids] == [2, 3]

    # n > 1: each prompt expands into n requests, prompt-major; seeds give distinct samples
    n = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "n": 3, "temperature": 1.0, "sampling_seed": 7}})
    assert isinstance(n, list) and len(n) == 3
    again = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 8, "n": 3, "temperature": 1.0, "sampling_seed": 7}})
    assert [x["output_ids"] for x in n] == [x["output_ids"] for x in again]  # reproducible
    assert len({tuple(x["output_ids"]) for x in n}) > 1

    chunks = stream(minisgl_server, {"text": prompts, "sampling_params": {**params, "n": 2}})
    assert {c["index"] for c in chunks} == {0, 1, 2, 3}
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert finals[0]["output_ids"] == finals[1]["output_ids"] == singles[0]["output_ids"]
    assert finals[2]["output_ids"] == finals[3]["output_ids"] == singles[1]["output_ids"]


def test_logprobs(minisgl_server):
    result = generate(minisgl_server, {"text": PROMPT, "sampling_params": GREEDY,
                                       "return_logprob": True, "top_logprobs_num": 3,
                                       "logprob_start_len": 0, "return_text_in_logprobs": True})
    meta = result["meta_info"]
    tokens, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(tokens) == len(tops) == meta["completion_tokens"]
    assert [t[1] for t in tokens] == result["output_ids"]
    assert "".join(t[2] for t in tokens) == result["text"]
    for (lp, tid, _), top in zip(tokens, tops):
        assert len(top) == 3 and lp <= 0
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-4  # greedy picks the top one
        assert top[0][0] >= top[1][0] >= top[2][0]
    # input logprobs from position 0 (values are checked against transformers in
    # test_scheduler.py): one entry per prompt token, the first None, texts spell the prompt
    inputs, input_tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(inputs) == len(input_tops) == meta["prompt_tokens"]
    assert inputs[0][0] is None and input_tops[0] is None
    assert all(lp <= 0 and len(top) == 3 for (lp, _, _), top in zip(inputs[1:], input_tops[1:]))
    assert "".join(t[2] for t in inputs) == PROMPT
    # -1 (the default) starts at the end of the prompt: no prompt entries, as in SGLang
    for start in ({}, {"logprob_start_len": -1}):
        default = generate(minisgl_server, {"text": PROMPT, "sampling_params": GREEDY,
                                            "return_logprob": True, **start})["meta_info"]
        assert default["input_token_logprobs"] == default["input_top_logprobs"] == []
        assert [t[1] for t in default["output_token_logprobs"]] == [t[1] for t in tokens]
    plain = generate(minisgl_server, {"text": PROMPT, "sampling_params": GREEDY})
    assert "output_token_logprobs" not in plain["meta_info"]


def test_greedy_matches_transformers(minisgl_server):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = get(minisgl_server, "/get_model_info").json()["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    flush(minisgl_server)
    result = generate(minisgl_server, {"text": PROMPT,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
    assert result["meta_info"]["prompt_tokens"] == ids.shape[1]
    assert result["output_ids"] == ref
    assert result["text"] == tokenizer.decode(ref, skip_special_tokens=True)


# ---- bad input -------------------------------------------------------------------------------

BAD_GENERATE = {
    "malformed JSON": b'{"text": "a",',
    "body is not an object": b"[1, 2]",
    "text of the wrong type": {"text": 5},
    "neither text nor input_ids": {"sampling_params": {}},
    "sampling_params not an object": {"text": "a", "sampling_params": "greedy"},
    "max_new_tokens of the wrong type": {"text": "a", "sampling_params": {"max_new_tokens": "5"}},
    "unknown sampling parameter": {"text": "a", "sampling_params": {"temprature": 0}},
    "temperature out of range": {"text": "a", "sampling_params": {"temperature": -1}},
    "top_p out of range": {"text": "a", "sampling_params": {"top_p": 1.5}},
    "repetition_penalty out of range": {"text": "a", "sampling_params": {"repetition_penalty": 3}},
    "stream of the wrong type": {"text": "a", "stream": "yes"},
    "rid of the wrong type": {"text": "a", "rid": 5},
    "empty text": {"text": ""},
    "empty input_ids": {"input_ids": []},
    "token id beyond the vocabulary": {"input_ids": [10**9]},
    "top_logprobs_num too large": {"text": "a", "return_logprob": True, "top_logprobs_num": 10**6},
    "logprob_start_len past the prompt": {"input_ids": [1, 2], "return_logprob": True,
                                          "logprob_start_len": 2},
    "batch with one bad sampling_params": {
        "text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"temperature": -1}]},
    "batch with one empty prompt": {"text": ["a", ""]},
    "batch with one prompt too long": {"input_ids": [[1, 2], [3] * 8190],
                                       "sampling_params": {"max_new_tokens": 8}},
    "batch with duplicate rids": {"text": ["a", "b"], "rid": ["x", "x"]},
}


def test_bad_requests_get_400_and_disturb_nothing(minisgl_server):
    requests_before = requests_total(minisgl_server)
    with ThreadPoolExecutor(1) as pool:
        # a good stream runs while bad requests come in
        good = pool.submit(stream, minisgl_server, {
            "text": PROMPT, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}})
        for name, body in BAD_GENERATE.items():
            if isinstance(body, bytes):
                r = post(minisgl_server, "/generate", data=body,
                         headers={"Content-Type": "application/json"})
            else:
                r = post(minisgl_server, "/generate", body)
            error = assert_error(r, 400)
            assert error["type"] == "invalid_request_error", name
        chunks = good.result(timeout=120)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    # nothing of the bad requests was ever queued (the good stream is the one new request)
    assert requests_total(minisgl_server) == requests_before + 1
    assert get(minisgl_server, "/health").status_code == 200


def test_context_length_error_names_the_numbers(minisgl_server):
    error = assert_error(post(minisgl_server, "/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": 9000}}), 400)
    assert "8192" in error["message"] and "9000" in error["message"]


def test_oversize_body_gets_413(minisgl_server):
    body = b'{"text": "' + b"a" * (33 * 2**20) + b'"}'
    r = post(minisgl_server, "/generate", data=body, headers={"Content-Type": "application/json"})
    assert_error(r, 413)
    assert get(minisgl_server, "/health").status_code == 200


# ---- disconnects -----------------------------------------------------------------------------

def _open(server: Any, body: dict[str, Any]
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse | None]:
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    return conn, (conn.getresponse() if body.get("stream") else None)


def test_stream_disconnect_aborts_and_frees_pages(minisgl_server):
    flush(minisgl_server)
    baseline = state(minisgl_server)
    assert baseline["kv_used_tokens"] == 0 and baseline["num_running_reqs"] == 0
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    conn, response = _open(minisgl_server, body)
    assert response.status == 200
    seen = 0
    while seen < 3:
        if response.readline().startswith(b"data: "):
            seen += 1
    during = state(minisgl_server)
    assert during["num_running_reqs"] == 1 and during["kv_used_tokens"] > 0
    generated_before = during["generated_tokens"]
    response.close()
    conn.close()
    assert_idle_and_freed(minisgl_server)
    assert state(minisgl_server)["generated_tokens"] - generated_before < 500


def test_non_stream_disconnect_aborts_and_frees_pages(minisgl_server):
    flush(minisgl_server)
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    conn, _ = _open(minisgl_server, body)
    running = wait_for(lambda: (lambda s: s if s["num_running_reqs"] == 1 else None)(
        state(minisgl_server)), what="the request to run")
    assert running["kv_used_tokens"] > 0
    conn.close()  # without reading: the handler is cancelled, the request aborted
    assert_idle_and_freed(minisgl_server)
    assert state(minisgl_server)["generated_tokens"] - running["generated_tokens"] < 500


# ---- a second server, API keys, queue limits, SIGINT -------------------------------------------

def test_second_server_concurrently(minisgl_server, minisgl_server_factory):
    other = minisgl_server_factory("--api-key", "sekret", "--max-queued-requests", "2")
    assert other.url != minisgl_server.url
    auth = {"Authorization": "Bearer sekret"}
    assert get(other, "/health").status_code == 200  # health stays open
    body = {"text": PROMPT, "sampling_params": GREEDY}
    assert_error(post(other, "/generate", body), 401)
    assert_error(post(other, "/generate", body, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(get(other, "/v1/models"), 401)
    assert_error(get(other, "/get_server_info"), 401)

    # both servers answer at the same time, with the same greedy text
    with ThreadPoolExecutor(4) as pool:
        mine = [pool.submit(generate, minisgl_server, body) for _ in range(2)]
        theirs = [pool.submit(lambda: post(other, "/generate", body, headers=auth))
                  for _ in range(2)]
        texts = {f.result()["text"] for f in mine}
        responses = [f.result() for f in theirs]
    assert all(r.status_code == 200 for r in responses)
    assert texts == {r.json()["text"] for r in responses} and len(texts) == 1

    # a batch larger than the waiting queue allows: 503, nothing queued
    r = post(other, "/generate", {"text": ["a", "b", "c"]}, headers=auth)
    assert_error(r, 503, "queue")

    # SIGINT while a stream runs: the stream ends with an abort, the server exits 0
    r = requests.post(other.url + "/generate", headers=auth, stream=True, timeout=60, json={
        "text": PROMPT, "stream": True,
        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
    lines = r.iter_lines()
    assert next(l for l in lines if l).startswith(b"data: {")
    children = psutil.Process(other.proc.pid).children(recursive=True)
    code = other.stop(signal.SIGINT)
    assert code == 0, other.log()
    rest = [l for l in lines if l]
    assert rest[-1] == b"data: [DONE]"
    last = json.loads(rest[-2][len(b"data: "):])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert not [c for c in children if c.is_running()]
    # the first server was not disturbed
    assert get(minisgl_server, "/health").status_code == 200


# ---- a dead scheduler ----------------------------------------------------------------------------

def test_dead_scheduler_turns_health_503_and_ends_requests():
    """In-process (the same Server and Runtime that `serve` runs): when the scheduler
    task dies, /health answers 503, the request in flight ends with an abort instead of
    hanging, and new requests get 503."""
    import asyncio

    import aiohttp

    from minisgl.runtime import Runtime
    from minisgl.server.app import Server
    from minisgl.server.listen import bind
    from minisgl.server.serve import listen
    from minisgl.args import ServerArgs

    async def scenario() -> None:
        args = ServerArgs(dtype="float32", max_total_tokens=4096, max_running_requests=4)
        runtime = Runtime(args)
        await runtime.start()
        manager = runtime.requests
        server = Server(runtime)
        runner, port = await listen(server, bind("127.0.0.1", 0))
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4000,
                                                            "ignore_eos": True}}
                pending = asyncio.create_task(session.post(url + "/generate", json=body))
                while not manager.handles:
                    await asyncio.sleep(0.01)
                manager._tasks[0].cancel()  # the scheduler task dies
                async with await asyncio.wait_for(pending, 30) as r:
                    assert r.status == 200
                    result = await r.json()
                assert result["meta_info"]["finish_reason"]["type"] == "abort"
                async with session.get(url + "/health") as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == 503
                async with session.post(url + "/generate", json=body) as r:
                    assert r.status == 503
        finally:
            await runner.cleanup()
            await runtime.stop()

    asyncio.run(scenario())

"""Bad input, odd values and abusive requests, tried as a user and as an attacker would: a real
`python -m minisgl serve`, real HTTP clients and raw sockets, real processes for the CLI and
the offline API. Every refusal is a 4xx with a JSON message and disturbs nothing else."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import requests

from tests.conftest import REPO_ROOT
from tests.test_server import (PROMPT, assert_error, assert_idle_and_freed, generate, get, post,
                               requests_total, state, stream, wait_for)

GREEDY = {"temperature": 0, "max_new_tokens": 8}
# protocol, not numerics: the bundled model's shape and tokenizer, 2 layers of random weights
SHALLOW = ("--load-format", "dummy", "--json-model-override-args", '{"num_hidden_layers": 2}')
SERVER_ARGS = SHALLOW  # the module's server (conftest's minisgl_server)


def counters(server: Any) -> tuple[int, int]:
    """(requests accepted, prompt tokens queued): both unchanged means nothing was queued."""
    return requests_total(server), state(server)["prompt_tokens"]


def port_of(server: Any) -> int:
    return urlsplit(server.url).port


def raw_exchange(server: Any, payload: bytes, close_early: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        sock.sendall(payload)
        if close_early:
            return b""
        chunks = []
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)


# ---- 1. booleans take only true / false --------------------------------------------------------

@pytest.mark.parametrize("value", ["false", "0", 0, 1, [1], {"x": 1}])
def test_abort_all_takes_only_a_boolean(minisgl_server, value):
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, minisgl_server, {
            "text": PROMPT, "rid": "keep-running",
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}})
        wait_for(lambda: state(minisgl_server)["num_running_reqs"] == 1, what="running")
        error = assert_error(post(minisgl_server, "/abort_request", {"abort_all": value}), 400)
        assert "abort_all" in error["message"]
        chunks = running.result(timeout=120)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}


BAD_BOOLEANS = [
    ("/generate", {"text": PROMPT, "stream": "false"}, "stream"),
    ("/generate", {"text": PROMPT, "return_logprob": 1}, "return_logprob"),
    ("/generate", {"text": [PROMPT, PROMPT], "return_logprob": [True, "yes"]}, "return_logprob"),
    ("/generate", {"text": PROMPT, "return_text_in_logprobs": "true"}, "return_text_in_logprobs"),
    ("/generate", {"text": PROMPT, "log_metrics": "no"}, "log_metrics"),
    ("/generate", {"text": PROMPT, "top_logprobs_num": False}, "top_logprobs_num"),
    ("/generate", {"text": PROMPT, "sampling_params": {"ignore_eos": "false"}}, "ignore_eos"),
    ("/generate", {"text": PROMPT, "sampling_params": {"skip_special_tokens": 0}},
     "skip_special_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "true"}, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 0},
     "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": "yes"}}, "include_usage"),
]


@pytest.mark.parametrize("path,body,field", BAD_BOOLEANS)
def test_boolean_fields_refuse_other_types(minisgl_server, path, body, field):
    before = counters(minisgl_server)
    error = assert_error(post(minisgl_server, path, body), 400)
    assert field in error["message"]
    assert counters(minisgl_server) == before


# ---- 2. extreme sampling values ----------------------------------------------------------------

@pytest.mark.parametrize("extreme", [{"temperature": 1e-39}, {"temperature": 1e-320},
                                     {"top_p": 5e-324}, {"top_p": 1e-7, "temperature": 1.5}])
def test_tiny_temperature_or_top_p_runs_greedy(minisgl_server, extreme):
    greedy = generate(minisgl_server, {"text": PROMPT, "sampling_params": GREEDY})
    out = generate(minisgl_server, {"text": PROMPT,
                                    "sampling_params": {"max_new_tokens": 8, **extreme}})
    assert out["output_ids"] == greedy["output_ids"] and out["text"] == greedy["text"]


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_extreme_seeds_are_served(minisgl_server, seed):
    out = generate(minisgl_server, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 4, "sampling_seed": seed, "n": 2}})
    assert [len(o["output_ids"]) for o in out] == [4, 4]


# ---- 3. a batch is validated whole, at every position ------------------------------------------

def _bad_items(vocab: int) -> dict[str, tuple[dict[str, Any], str]]:
    """name -> (the batch item's override, a word the error names)."""
    return {
        "empty prompt": ({"input_ids": []}, "empty"),
        "token out of vocabulary": ({"input_ids": [1, vocab]}, "input_ids"),
        "logit_bias out of vocabulary": ({"sampling_params": {"logit_bias": {str(vocab): 1}}},
                                         "logit_bias"),
        "too long for the context": ({"sampling_params": {"max_new_tokens": 9000}}, "context"),
        "logprob_start_len past the prompt": ({"logprob_start_len": 5, "return_logprob": True},
                                              "logprob_start_len"),
        "rid already running": ({"rid": "busy"}, "busy"),
        "too many stop strings": ({"sampling_params": {"stop": ["x"] * 65}}, "stop"),
        "stop string too long": ({"sampling_params": {"stop": ["y" * 1025]}}, "stop"),
        "bad sampling parameter": ({"sampling_params": {"top_p": 0}}, "top_p"),
    }


def _batch(size: int, bad_at: int, override: dict[str, Any]) -> dict[str, Any]:
    items = [{"input_ids": [10 + i, 20, 30], "sampling_params": {"max_new_tokens": 2},
              "rid": f"item-{i}", "return_logprob": False, "logprob_start_len": -1}
             for i in range(size)]
    items[bad_at] = {**items[bad_at], **override}
    if "sampling_params" in override:
        items[bad_at]["sampling_params"] = {"max_new_tokens": 2, **override["sampling_params"]}
    return {key: [item[key] for item in items] for key in items[0]}


@pytest.mark.parametrize("bad_at", [0, 1, 2])
def test_batch_with_one_bad_item_queues_nothing(minisgl_server, bad_at):
    vocab = 49152
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(stream, minisgl_server, {
            "text": PROMPT, "rid": "busy",
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})
        wait_for(lambda: state(minisgl_server)["num_running_reqs"] == 1, what="busy running")
        before = counters(minisgl_server)
        for name, (override, word) in _bad_items(vocab).items():
            error = assert_error(post(minisgl_server, "/generate",
                                      _batch(3, bad_at, override)), 400)
            assert word in error["message"], (name, error)
            if name != "bad sampling parameter":  # parsed before the batch is formed
                assert f"batch item {bad_at}" in error["message"], (name, error)
            assert counters(minisgl_server) == before, name
        post(minisgl_server, "/abort_request", {"rid": "busy"})
        busy.result(timeout=120)
    # the same batches, repaired, run
    assert len(generate(minisgl_server, _batch(3, bad_at, {}))) == 3


def test_openai_batch_with_one_bad_prompt_queues_nothing(minisgl_server):
    before = counters(minisgl_server)
    for bad_at in range(3):
        prompts: list[Any] = [[11, 12], [13, 14], [15, 16]]
        prompts[bad_at] = [1, 10**6]
        error = assert_error(post(minisgl_server, "/v1/completions",
                                  {"prompt": prompts, "max_tokens": 2}), 400)
        assert f"batch item {bad_at}" in error["message"]
    assert counters(minisgl_server) == before


# ---- 4. limits ---------------------------------------------------------------------------------

def test_fan_out_is_limited(minisgl_server):
    before = counters(minisgl_server)
    body = {"input_ids": [[1, 2]] * 64, "sampling_params": {"n": 256, "max_new_tokens": 1}}
    error = assert_error(post(minisgl_server, "/generate", body), 400)
    assert "16384 sequences" in error["message"] and "--max-sequences-per-request" in \
        error["message"]
    error = assert_error(post(minisgl_server, "/v1/completions", {
        "prompt": ["a"] * 64, "n": 256, "max_tokens": 1}), 400)
    assert "sequences" in error["message"]
    assert counters(minisgl_server) == before


def test_stop_strings_are_limited(minisgl_server):
    before = counters(minisgl_server)
    many = {"text": PROMPT, "sampling_params": {"stop": [f"s{i}" for i in range(10_000)]}}
    assert "--max-stop-strings" in assert_error(post(minisgl_server, "/generate", many),
                                                400)["message"]
    long = {"text": PROMPT, "sampling_params": {"stop": "z" * 2**20}}
    assert "--max-stop-string-length" in assert_error(post(minisgl_server, "/generate", long),
                                                      400)["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "stop": ["q"] * 100}
    assert "stop" in assert_error(post(minisgl_server, "/v1/chat/completions", chat),
                                  400)["message"]
    assert counters(minisgl_server) == before


def test_huge_prompt_is_refused_before_tokenization(minisgl_server):
    before = counters(minisgl_server)
    text = "word " * 6_000_000  # 30 MB: at most 81 characters per token, 8192 tokens of context
    error = assert_error(post(minisgl_server, "/generate", {"text": text}), 400)
    assert "30000000 characters" in error["message"]
    chat = {"messages": [{"role": "user", "content": text}]}
    assert "characters" in assert_error(post(minisgl_server, "/v1/chat/completions", chat),
                                        400)["message"]
    assert counters(minisgl_server) == before
    assert get(minisgl_server, "/health").status_code == 200


# ---- 5. what clients get wrong at the HTTP level is not an error of the server ---------------

def test_malformed_http_and_vanishing_clients_log_no_errors(minisgl_server):
    logged = len(minisgl_server.stderr)
    assert raw_exchange(minisgl_server, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.")
    tls_hello = bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) * 4
    assert b"400" in raw_exchange(minisgl_server, tls_hello)[:20]
    bad_length = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
    assert b"400" in raw_exchange(minisgl_server, bad_length)[:20]
    body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 64}}).encode()
    head = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    raw_exchange(minisgl_server, head + body[:10], close_early=True)  # vanishes mid-body
    raw_exchange(minisgl_server, head + body, close_early=True)  # vanishes mid-generation
    stream_head = head.replace(b"Content-Length: %d" % len(body), b"Content-Length: %d" % (
        len(body) + len(b', "stream": true')))
    raw_exchange(minisgl_server, stream_head + body[:-1] + b', "stream": true}',
                 close_early=True)
    wait_for(lambda: state(minisgl_server)["num_running_reqs"] == 0, what="aborted")
    assert get(minisgl_server, "/health").status_code == 200
    new = "".join(minisgl_server.stderr[logged:])
    assert "Traceback" not in new and " ERROR " not in new, new


def test_client_fault_filter_keeps_server_faults_at_error():
    """The filter the server installs on aiohttp's logger: a client's fault becomes one debug
    line, a fault of the server's stays an error with its traceback."""
    import logging

    from aiohttp.http_exceptions import BadHttpMessage

    from minisgl.server.listen import ClientFaultFilter

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1,
                                     "Error handling request from %s", ("1.2.3.4",),
                                     sys.exc_info())

    client = record(BadHttpMessage("bad"))
    ClientFaultFilter().filter(client)
    assert client.levelno == logging.DEBUG and client.exc_info is None
    assert "1.2.3.4" in client.getMessage() and "BadHttpMessage" in client.getMessage()
    server = record(KeyError("bug"))
    assert ClientFaultFilter().filter(server)
    assert server.levelno == logging.ERROR and server.exc_info is not None


# ---- 6. flags are checked at start, the port before the model loads --------------------------

def _serve(*flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minisgl", "serve", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags,names", [
    (("--port", "99999"), "--port"), (("--port", "-1"), "--port"),
    (("--max-total-tokens", "-5"), "--max-total-tokens"),
    (("--chunked-prefill-size", "0"), "--chunked-prefill-size"),
    (("--mem-fraction-static", "1.5"), "--mem-fraction-static"),
    (("--schedule-policy", "bogus"), "--schedule-policy"),
    (("--priority-scheduling-preemption-threshold", "-1"),
     "--priority-scheduling-preemption-threshold"),
    (("--max-stop-strings", "0"), "--max-stop-strings"),
    (("--tp-size", "x"), "--tp-size"),
])
def test_bad_flags_exit_2_with_one_line(flags, names):
    done = _serve(*flags)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0] and lines[0].startswith("error:"), done.stderr
    assert "loading model" not in done.stderr + done.stdout


def test_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _serve("--port", str(taken.getsockname()[1]))
    assert done.returncode == 2, done
    assert "cannot listen" in done.stderr and "loading model" not in done.stderr, done.stderr


# ---- 7. browsers: content type, Host, origins -------------------------------------------------

def test_json_endpoints_need_a_json_content_type(minisgl_server):
    before = counters(minisgl_server)
    body = json.dumps({"text": PROMPT, "sampling_params": GREEDY})
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"):
        for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-"
                                                         "urlencoded"}, {}):
            r = requests.post(minisgl_server.url + path, data=body, headers=headers, timeout=30)
            assert_error(r, 415, "application/json")
    assert counters(minisgl_server) == before
    r = requests.post(minisgl_server.url + "/generate", data=body, timeout=120,
                      headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_host_header_must_name_this_server(minisgl_server):
    port = port_of(minisgl_server)
    for host in ("evil.example", f"evil.example:{port}", "attacker.localhost.example", "[bad"):
        r = requests.get(minisgl_server.url + "/get_model_info", headers={"Host": host},
                         timeout=30)
        assert_error(r, 400, "Host")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST", f"[::1]:{port}"):
        r = requests.get(minisgl_server.url + "/get_model_info", headers={"Host": host},
                         timeout=30)
        assert r.status_code == 200, (host, r.text)


def test_cross_site_browser_requests_are_refused(minisgl_server):
    before = counters(minisgl_server)
    generate_body = {"text": PROMPT, "sampling_params": GREEDY}
    cross = [({"Origin": "http://evil.example"}, "/generate", generate_body),
             ({"Origin": "null"}, "/abort_request", {"abort_all": True}),
             ({"Sec-Fetch-Site": "cross-site"}, "/flush_cache", None),
             ({"Sec-Fetch-Site": "same-site"}, "/flush_cache", None)]
    for headers, path, body in cross:
        r = requests.post(minisgl_server.url + path, json=body, headers=headers, timeout=30)
        assert_error(r, 403, "--cors-origins")
        assert "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(minisgl_server.url + "/flush_cache", timeout=30,
                     headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"})
    assert_error(r, 403)  # an <img> on another site's page
    assert counters(minisgl_server) == before
    # the server's own origin, and a user typing the address, are fine
    own = {"Origin": minisgl_server.url, "Sec-Fetch-Site": "same-origin"}
    r = requests.post(minisgl_server.url + "/generate", json=generate_body, headers=own,
                      timeout=120)
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(minisgl_server.url + "/health", headers={"Sec-Fetch-Site": "none"},
                     timeout=30)
    assert r.status_code == 200


def test_listed_hosts_origins_and_case_insensitive_bearer(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, "--api-key", "sekrit",
                                    "--allowed-hosts", "llm.internal,other.internal",
                                    "--cors-origins", "http://app.example")
    body = {"text": PROMPT, "sampling_params": GREEDY}
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = requests.post(server.url + "/generate", json=body, timeout=120,
                          headers={"Authorization": f"{scheme} sekrit"})
        assert r.status_code == 200, (scheme, r.text)
    assert_error(requests.post(server.url + "/generate", json=body, timeout=30,
                               headers={"Authorization": "Basic sekrit"}), 401)
    auth = {"Authorization": "Bearer sekrit"}
    r = requests.get(server.url + "/get_model_info", timeout=30,
                     headers={**auth, "Host": "llm.internal:8080"})
    assert r.status_code == 200, r.text
    assert_error(requests.get(server.url + "/get_model_info", timeout=30,
                              headers={**auth, "Host": "evil.example"}), 400)
    # a listed origin: preflight, then the answer carries the CORS header (streams too)
    origin = {"Origin": "http://app.example"}
    r = requests.options(server.url + "/generate", timeout=30, headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 204 and "POST" in r.headers["Access-Control-Allow-Methods"]
    assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, timeout=120,
                      headers={**auth, **origin})
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    r = requests.options(server.url + "/generate", timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert_error(r, 403)


# ---- 8. OpenAI: roles and model names ----------------------------------------------------------

def test_openai_roles_and_model_names(minisgl_server):
    before = counters(minisgl_server)
    for role in ("wizard", "function", "System"):
        r = post(minisgl_server, "/v1/chat/completions",
                 {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
        assert_error(r, 400, role)
    assert counters(minisgl_server) == before
    served = get(minisgl_server, "/v1/models").json()["data"][0]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        # as SGLang: one model per server answers to any name, and says its own
        r = post(minisgl_server, path, {**body, "model": "gpt-4o", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == served["id"], r.text
    client = openai.OpenAI(base_url=minisgl_server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for model in (served["id"], served["root"], ""):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert out.choices[0].message.content is not None
    r = post(minisgl_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200, r.text  # no model at all


# ---- 9. the offline API ------------------------------------------------------------------------

LLM_SCRIPT = """
from minisgl import LLM
llm = LLM(dtype="float32", load_format="dummy",
          json_model_override_args='{"num_hidden_layers": 2}')
print(repr(llm.generate(prompt="Hello", sampling_params={"max_new_tokens": 3})["text"]))
"""

LLM_SHUTDOWN_SCRIPT = """
from minisgl import LLM
with LLM(dtype="float32", load_format="dummy",
          json_model_override_args='{"num_hidden_layers": 2}') as llm:
    llm.generate(prompt="Hello", sampling_params={"max_new_tokens": 2})
llm.shutdown()  # again: nothing happens
try:
    llm.generate(prompt="Hello")
except RuntimeError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("script", [LLM_SCRIPT, LLM_SHUTDOWN_SCRIPT])
def test_offline_llm_ends_quietly(script):
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for noise in ("Traceback", "Task was destroyed", "Event loop is closed", "Exception ignored"):
        assert noise not in done.stderr, done.stderr
    if script is LLM_SHUTDOWN_SCRIPT:
        assert "refused: this LLM was shut down" in done.stdout


def test_offline_batch_is_validated_whole():
    from minisgl import LLM
    from minisgl.errors import InvalidRequest

    with LLM(dtype="float32", load_format="dummy", max_total_tokens=512, max_running_requests=4,
             json_model_override_args='{"num_hidden_layers": 2}') as llm:
        metrics = llm.runtime.requests.metrics
        bad_items = {"input_ids": ([1, 10**6], None), "pool": ([1, 2], {"max_new_tokens": 600}),
                     "logit_bias": ([1, 2], {"logit_bias": {"49152": 1}}),
                     "temperature": ([1, 2], {"temperature": float("nan")})}
        for name, (ids, params) in bad_items.items():
            for bad_at in range(3):
                batch = [[5 + i, 6] for i in range(3)]
                sampling = [{"max_new_tokens": 2}] * 3
                batch[bad_at] = ids
                if params is not None:
                    sampling = [*sampling]
                    sampling[bad_at] = {"max_new_tokens": 2, **params}
                with pytest.raises(InvalidRequest, match=name):
                    llm.generate(input_ids=batch, sampling_params=sampling)
                assert metrics.requests == 0 and not llm.runtime.requests.handles, name
        out = llm.generate(input_ids=[[5, 6], [7, 8]], sampling_params={"max_new_tokens": 2})
        assert [len(o["output_ids"]) for o in out] == [2, 2]
        llm.check_integrity()


def test_flags_listed_in_help():
    done = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    for flag in ("--allowed-hosts", "--cors-origins", "--max-sequences-per-request",
                 "--max-stop-strings", "--max-stop-string-length", "--max-request-bytes",
                 "--served-model-name"):
        assert flag in done.stdout


def test_server_keeps_serving_after_all_this(minisgl_server):
    out = generate(minisgl_server, {"text": PROMPT, "sampling_params": GREEDY})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert_idle_and_freed(minisgl_server)

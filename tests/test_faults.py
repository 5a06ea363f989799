"""What a client sees when part of the server fails or misbehaves, on real servers: an
exception inside a step, a client that stops reading its stream, a thousand clients that hang
up mid-stream, a SIGTERM during a deploy; and the keys and folders that guard the endpoints
which change the server. (A tensor-parallel rank killed mid-stream: tests/test_tp.py.)"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from tests.test_hardening import SHALLOW
from tests.test_server import (PROMPT, assert_error, assert_idle_and_freed, get, post, state,
                               wait_for)

GREEDY = {"temperature": 0, "max_new_tokens": 8}
LONG = {"max_new_tokens": 6000, "ignore_eos": True}  # runs far past any wait below
FAILS_WITHIN_S = 10.0


def open_stream(server: Any, body: dict[str, Any], headers: dict[str, str] | None = None
                ) -> tuple[requests.Response, Any]:
    """A native stream under way: the response and its event lines (first event read)."""
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                      timeout=120, headers=headers)
    assert r.status_code == 200, r.text
    lines = r.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: {")
    return r, lines


def last_event(lines: Any) -> tuple[dict[str, Any], bool]:
    """The stream's last JSON event, and whether [DONE] followed it."""
    events = [line[len(b"data: "):] for line in lines if line]
    done = events[-1] == b"[DONE]"
    return json.loads(events[-2] if done else events[-1]), done


# ---- an exception inside a step --------------------------------------------------------------

def test_exception_in_a_step_ends_every_request_and_exits_1(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, env={"MINISGL_FAULT_AFTER_STEPS": "40"})
    started = time.monotonic()
    streams = [open_stream(server, {"text": f"{i} {PROMPT}", "sampling_params": LONG})[1]
               for i in range(2)]
    for lines in streams:  # the step fails on its own within 40 steps: both end
        last, done = last_event(lines)
        assert done and last["meta_info"]["finish_reason"]["type"] == "abort"
        assert "InjectedFault" in last["meta_info"]["finish_reason"]["message"]
    assert time.monotonic() - started < FAILS_WITHIN_S
    try:  # until it exits, the server refuses new work
        assert get(server, "/health").status_code == 503
        assert_error(post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}),
                     503)
    except requests.ConnectionError:
        pass  # already gone
    assert server.proc.wait(timeout=30) == 1
    errors = [line for line in server.stderr if " ERROR " in line]
    cause = [line for line in errors if "InjectedFault: a fault injected" in line]
    assert len(cause) == 1 and "minisgl-scheduler stopped" in cause[0], server.log()
    assert len(errors) == 2 and "exiting" in errors[1], errors  # then its trace, then the exit


# ---- a client that stops reading -------------------------------------------------------------

def test_a_stream_nobody_reads_is_aborted_with_memory_flat(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, "--stream-write-timeout", "2")
    url = urlsplit(server.url)
    body = json.dumps({"text": PROMPT, "stream": True, "sampling_params": LONG}).encode()
    process = psutil.Process(server.proc.pid)
    rss_before = process.memory_info().rss
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the client's side small
        sock.connect((url.hostname, url.port))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n%s" % (url.hostname.encode(), url.port,
                                                            len(body), body))
        wait_for(lambda: state(server)["num_running_reqs"] == 1, what="the stream to run")
        # it fills the buffers with cumulative events, waits 2 s on its client, is aborted
        wait_for(lambda: state(server)["num_running_reqs"] == 0, timeout=60,
                 what="the unread stream to be aborted")
        generated = state(server)["generated_tokens"]
        assert generated < LONG["max_new_tokens"]
        assert "read nothing for 2 s" in "".join(server.stderr), server.log()
    assert_idle_and_freed(server)
    assert process.memory_info().rss - rss_before < 64 * 2**20
    assert post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}
                ).status_code == 200


# ---- a thousand clients that hang up ---------------------------------------------------------

async def hang_up_after_first_event(host: str, port: int, body: bytes) -> bool:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST /generate HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (host.encode(), port, len(body), body))
        while True:
            line = await asyncio.wait_for(reader.readline(), 60)
            if not line:
                return False
            if line.startswith(b"data: {"):
                return True
    finally:
        writer.close()


def test_a_thousand_clients_hang_up_mid_stream(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, "--max-running-requests", "64")
    url = urlsplit(server.url)
    process = psutil.Process(server.proc.pid)
    assert post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}
                ).status_code == 200
    fds_before = process.num_fds()

    async def clients() -> list[bool]:
        gate = asyncio.Semaphore(100)

        async def one(i: int) -> bool:
            body = json.dumps({"text": f"{i} {PROMPT}", "stream": True,
                               "sampling_params": LONG}).encode()
            async with gate:
                return await hang_up_after_first_event(url.hostname, url.port, body)
        return await asyncio.gather(*(one(i) for i in range(1000)))

    assert all(asyncio.run(clients()))
    assert_idle_and_freed(server)
    wait_for(lambda: process.num_fds() <= fds_before + 2, what="the connections' fds closed")
    assert get(server, "/health").status_code == 200
    assert post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY}
                ).status_code == 200


# ---- SIGTERM: drain, then abort ---------------------------------------------------------------

def test_sigterm_drains_running_requests_then_exits_0(minisgl_server_factory):
    server = minisgl_server_factory(*SHALLOW, "--shutdown-timeout", "10")
    _, long_lines = open_stream(server, {"text": PROMPT, "sampling_params": LONG})
    short_lines = [open_stream(server, {"text": f"{i} {PROMPT}", "sampling_params": {
        "max_new_tokens": 24, "ignore_eos": True}})[1] for i in range(2)]
    server.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    time.sleep(0.5)
    try:
        refused = post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY})
    except requests.ConnectionError:
        raise AssertionError(server.log()) from None
    assert_error(refused, 503, "shutting down")
    assert refused.headers["Retry-After"] == "1"
    health = get(server, "/health")
    assert health.status_code == 503 and "Retry-After" in health.headers
    for lines in short_lines:  # the running ones finish whole
        last, done = last_event(lines)
        assert done and last["meta_info"]["finish_reason"]["type"] == "length", (last, server.log())
        assert last["meta_info"]["completion_tokens"] == 24
    last, done = last_event(long_lines)  # the one still running at the timeout is aborted
    assert done and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert time.monotonic() - signalled >= 9
    assert server.proc.wait(timeout=30) == 0, server.log()
    assert "running get up to 10 s to finish" in "".join(server.stderr)


# ---- the admin key and the adapter folders ----------------------------------------------------

def test_admin_key_guards_what_changes_the_server(minisgl_server_factory, tmp_path):
    allowed = tmp_path / "adapters"
    (allowed / "empty").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (allowed / "way-out").symlink_to(tmp_path / "elsewhere")
    server = minisgl_server_factory(*SHALLOW, "--api-key", "user", "--admin-api-key", "root",
                                    "--lora-dirs", str(allowed))
    user, admin = ({"Authorization": f"Bearer {key}"} for key in ("user", "root"))
    body = {"text": PROMPT, "sampling_params": GREEDY}
    for headers in (user, admin):  # the admin key serves the other endpoints too
        assert post(server, "/generate", body, headers=headers).status_code == 200
    assert_error(post(server, "/generate", body), 401)

    adapter = {"lora_name": "x", "lora_path": str(allowed / "empty")}
    admin_only = [("/flush_cache", None), ("/abort_request", {"abort_all": True}),
                  ("/load_lora_adapter", adapter), ("/v1/load_lora_adapter", adapter),
                  ("/unload_lora_adapter", {"lora_name": "x"}),
                  ("/v1/unload_lora_adapter", {"lora_name": "x"})]
    for path, payload in admin_only:
        assert_error(post(server, path, payload, headers=user), 403, "--admin-api-key")
        assert_error(post(server, path, payload), 401)
        assert_error(post(server, path, payload,
                          headers={"Authorization": "Bearer nope"}), 401)
    assert post(server, "/flush_cache", headers=admin).status_code == 200
    aborted = post(server, "/abort_request", {"abort_all": True}, headers=admin)
    assert aborted.json()["success"] is True
    # aborting one request by its id stays the user's
    assert post(server, "/abort_request", {"rid": "nobody"}, headers=user).status_code == 200

    # adapters load only from --lora-dirs: inside it the loader answers (400: not an
    # adapter); outside it, by name, by `..` or through a link, 403 names the rule
    inside = post(server, "/load_lora_adapter", adapter, headers=admin)
    assert inside.status_code == 400 and "not a PEFT adapter" in inside.text, inside.text
    for outside in (tmp_path, allowed / ".." / "elsewhere", allowed / "way-out",
                    "/etc", "relative/path"):
        refused = post(server, "/load_lora_adapter", {"lora_name": "x",
                                                      "lora_path": str(outside)},
                       headers=admin)
        assert_error(refused, 403, "--lora-dirs")
    assert get(server, "/health").status_code == 200


def test_without_lora_folders_no_adapter_path_loads(minisgl_server_factory, tmp_path):
    server = minisgl_server_factory(*SHALLOW, "--enable-lora")
    refused = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert_error(refused, 403, "none were given")


def test_lora_dirs_must_be_folders(tmp_path):
    from minisgl.args import ServerArgs
    with pytest.raises(ValueError, match="--lora-dirs: .* is not a folder"):
        ServerArgs(lora_dirs=[str(tmp_path / "missing")])

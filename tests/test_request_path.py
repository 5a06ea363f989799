"""The path of one request through the code: the minisgl files a live server enters for one
`/generate` and one streamed chat completion (traced by tests/request_trace.py: outside the
model's forward), at most MOST_FILES, none of a feature's modules for a request that does not
use the feature, and no call from a file into a higher layer (nothing calls back up)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from tests.conftest import READY, REPO_ROOT, SERVER_DEFAULT_ARGS, SERVER_START_TIMEOUT_S
from tests.test_architecture import rank
from tests.test_hardening import SHALLOW

MOST_FILES = {"generate": 21, "chat_stream": 25}  # a path short enough to hold in one's head
# what each feature alone enters: a request that does not use it must enter none of these
FEATURE_MODULES = {
    "LoRA": ("scheduler/lora.py", "engine/lora.py", "models/peft.py"),
    "speculation": ("scheduler/speculation.py", "engine/speculation.py", "engine/ngram.py",
                    "engine/draft_model.py", "engine/draft_budget.py", "engine/acceptance.py"),
    "grammar": ("grammar/backend.py", "grammar/matcher.py"),
    "embeddings": ("server/embeddings_api.py", "protocol/embeddings.py", "engine/pooling.py"),
    "input logprobs": ("engine/scoring.py",),
    "stop regexes": ("stop_regex.py",),
    "tool calls": ("protocol/openai_tools.py", "protocol/openai_tool_parser.py",
                   "protocol/openai_tool_scan.py", "protocol/openai_pythonic.py"),
    "stored responses": ("protocol/responses.py", "protocol/responses_store.py",
                         "server/responses_api.py"),
}


class TracedServer:
    def __init__(self, out: Path) -> None:
        self.out = out
        cmd = [sys.executable, str(REPO_ROOT / "tests" / "request_trace.py"), "serve",
               "--port", "0", *SERVER_DEFAULT_ARGS, *SHALLOW]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MINISGL_TRACE_OUT": str(out)}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, encoding="utf-8")
        self.lines: list[str] = []
        self.url = self._wait_ready()
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        for line in self.proc.stdout:
            self.lines.append(line)
            match = READY.search(line)
            if match:
                return match.group(1)
            if time.monotonic() > deadline:
                break
        self.proc.kill()
        raise RuntimeError("the traced server did not start:\n" + "".join(self.lines[-30:]))

    def trace(self, request: Callable[[str], None]) -> dict[str, Any]:
        """{"calls": {file: calls}, "edges": [[caller, callee, calls]]} of one request, sent
        once untraced first (first-use work aside)."""
        request(self.url)
        self.out.unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        request(self.url)
        time.sleep(0.5)  # NOTE: the detokenizer and the idle check finish after the answer
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not self.out.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return json.loads(self.out.read_text())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Any:
    server = TracedServer(tmp_path_factory.mktemp("trace") / "calls.json")
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


def generate(url: str) -> None:
    response = requests.post(url + "/generate", timeout=60, json={
        "text": "The capital of France is", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}})
    assert response.status_code == 200, response.text


def chat_stream(url: str) -> None:
    response = requests.post(url + "/v1/chat/completions", timeout=60, stream=True, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
    assert response.status_code == 200, response.text
    assert any(line == b"data: [DONE]" for line in response.iter_lines())


@pytest.mark.parametrize("request_kind", [generate, chat_stream], ids=lambda f: f.__name__)
def test_a_request_takes_a_short_path_through_no_unused_feature(traced, request_kind) -> None:
    traced_calls = traced.trace(request_kind)
    calls = traced_calls["calls"]
    files = sorted(calls)
    print(f"{request_kind.__name__}: {len(files)} files: {' '.join(files)}")
    assert "scheduler/scheduler.py" in files and "engine/engine.py" in files  # it traced
    assert len(files) <= MOST_FILES[request_kind.__name__], files
    entered = {feature: sorted(set(modules) & set(files))
               for feature, modules in FEATURE_MODULES.items()}
    assert not any(entered.values()), {f: m for f, m in entered.items() if m}
    assert not any(re.match(r"(models|layers|attention|kernels)/", f) for f in files)
    up = upward_calls(traced_calls["edges"])
    print(f"{request_kind.__name__}: calls up the layers: {up}")
    assert not up, up


def upward_calls(edges: list[list[Any]]) -> list[str]:
    """Direct calls from a file into a file of a higher layer (docs/design.md's order, as
    tests/test_architecture.py reads it): a lower layer calling back up, or a file re-entered
    from below."""
    def component(path: str) -> str:
        return path.removesuffix(".py").split("/")[0]

    return [f"{a} -> {b}" for a, b, _ in edges
            if component(a) != component(b) and rank(component(b)) > rank(component(a))]

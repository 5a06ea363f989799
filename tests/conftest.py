"""Shared fixtures.

Server fixtures: `minisgl_server` runs one real `python -m minisgl serve` subprocess per test
module (the bundled SmolLM2 in float32, on a port the OS picks; a module's `SERVER_ARGS` adds
flags, as a module that checks protocol, not numerics, serves two layers of random weights)
and stops it with SIGTERM at the end, asserting a clean exit. `minisgl_server_factory` starts
extra ones inside a test (`factory(*extra_flags)`); those still running at the end of the test
are stopped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from minisgl.models.gguf_reader import install as install_cheap_gguf_reads

# the tests' own GGUF readers (the files they write copy the bundled one's tokenizer) read as
# minisgl's do
install_cheap_gguf_reads()

REPO_ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"minisgl ready: listening on (http://\S+)")
SERVER_DEFAULT_ARGS = ("--dtype", "float32", "--max-total-tokens", "20000",
                       "--max-running-requests", "32")
SERVER_START_TIMEOUT_S = 180.0
SERVER_STOP_TIMEOUT_S = 30.0


@dataclass
class MinisglServer:
    """A running `python -m minisgl serve` subprocess."""

    proc: subprocess.Popen
    url: str
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.stdout[-50:]) + "".join(self.stderr[-50:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = SERVER_STOP_TIMEOUT_S) -> int:
        """Send `sig` and wait for the exit code; kill (and fail) if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit {timeout} s after signal {sig}:\n"
                                 + self.log()) from None


def _drain(stream, sink: list[str], ready: threading.Event | None = None,
           found: list[str] | None = None) -> None:
    for line in stream:
        sink.append(line)
        if ready is not None and not ready.is_set():
            match = READY.search(line)
            if match:
                found.append(match.group(1))
                ready.set()
    if ready is not None:
        ready.set()  # EOF: the process died before it was ready


def start_minisgl_server(*extra_args: str, timeout: float = SERVER_START_TIMEOUT_S,
                         env: dict[str, str] | None = None) -> MinisglServer:
    """Start a server on a free port (`--port 0`) and wait for its ready line; `env`: extra
    environment variables."""
    cmd = [sys.executable, "-m", "minisgl", "serve", "--port", "0", *SERVER_DEFAULT_ARGS,
           *extra_args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, encoding="utf-8")
    server = MinisglServer(proc, url="")
    ready, found = threading.Event(), []
    threading.Thread(target=_drain, args=(proc.stdout, server.stdout, ready, found),
                     daemon=True).start()
    threading.Thread(target=_drain, args=(proc.stderr, server.stderr), daemon=True).start()
    if not ready.wait(timeout) or not found:
        state = "still running" if proc.poll() is None else f"exit code {proc.returncode}"
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the server did not become ready in {timeout} s ({state}):\n"
                           f"{server.log()}")
    server.url = found[0]
    return server


@pytest.fixture(scope="module")
def minisgl_server(request):
    server = start_minisgl_server(*getattr(request.module, "SERVER_ARGS", ()))
    yield server
    code = server.stop(signal.SIGTERM)
    assert code == 0, f"server exited with {code} after SIGTERM:\n{server.log()}"


@pytest.fixture
def minisgl_server_factory():
    started: list[MinisglServer] = []

    def start(*extra_args: str, env: dict[str, str] | None = None) -> MinisglServer:
        server = start_minisgl_server(*extra_args, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.stop()

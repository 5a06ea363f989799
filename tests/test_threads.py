"""CPU threading invariant: the engine thread owns the process's only OpenMP team.

A torch op big enough to go parallel on the event loop's thread gives that thread a team of
its own; with more OpenMP threads than cores libgomp stops spinning between parallel regions
and every later engine step slowed down (BENCHMARKS.md). The server and `LLM` run their event
loop inside `no_openmp_on_this_thread`. Checked in a fresh interpreter: a team, once made,
lives as long as the process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT

PROBE = """
import os, torch
from minisgl.env import no_openmp_on_this_thread

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():  # far above ATen's grain size: runs as an OpenMP parallel region
    return torch.ones(1 << 22).mul_(2).sum()

torch.get_num_threads()
before = threads()
with no_openmp_on_this_thread():
    parallel_op()
    inside = threads(), torch.get_num_threads()
parallel_op()
print(before, *inside, threads(), torch.get_num_threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no team to avoid")
def test_event_loop_guard_keeps_parallel_ops_off_openmp() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    before, inside, threads_inside, after, threads_after = map(int, out)
    assert threads_inside == 1 and inside == before, "a team appeared inside the guard"
    assert threads_after == torch.get_num_threads(), "the guard did not restore the threads"
    assert after > before, "the same op outside the guard made no team: the probe is too small"

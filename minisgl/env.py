"""The process environment: every MINISGL_* variable, the cache folder, the thread
controls that keep OpenMP on the engine's thread, and giving freed heap memory back.

- MINISGL_CACHE_DIR: converted models and compiled kernels (default ~/.cache/minisgl)
- MINISGL_DISABLE_CPU_KERNELS: plain torch ops instead of the compiled CPU kernels
- MINISGL_DISABLE_CUDA_KERNELS: plain torch ops instead of FlashInfer's fused kernels
- MINISGL_CUDA_WAIT: how the scheduler awaits a CUDA forward: "thread" (default) or "poll"
- TOKENIZERS_PARALLELISM: set to false unless the user set it (quiet_tokenizer_threads)
- ONEDNN_PRIMITIVE_CACHE_CAPACITY, LRU_CACHE_CAPACITY: oneDNN's and ideep's caches, set to
  ONEDNN_CACHE_ENTRIES unless the user set them (bound_onednn_caches)
- MINISGL_FAULT_AFTER_STEPS: for fault tests only: the engine's step N+1 raises (rank 0)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Iterator

def cache_root() -> Path:
    return Path(os.environ.get("MINISGL_CACHE_DIR") or Path.home() / ".cache" / "minisgl")


def cpu_kernels_disabled() -> bool:
    return bool(os.environ.get("MINISGL_DISABLE_CPU_KERNELS"))


def cuda_kernels_disabled() -> bool:
    return bool(os.environ.get("MINISGL_DISABLE_CUDA_KERNELS"))


def fault_after_steps() -> int | None:
    value = os.environ.get("MINISGL_FAULT_AFTER_STEPS")
    return None if not value else int(value)


def quiet_tokenizer_threads() -> None:
    """NOTE: the tokenizer's own thread pool would spin next to the engine's threads on every
    batched detokenization step; long inputs leave the loop thread instead (runtime.tokenizer).
    A user's TOKENIZERS_PARALLELISM wins."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


ONEDNN_CACHE_ENTRIES = 64


def bound_onednn_caches() -> None:
    """NOTE: torch's bfloat16 CPU matmuls keep one oneDNN primitive per shape (and ideep one
    computation per shape), up to 1024 each, some holding a reordered copy of the weight:
    every new prompt or KV length adds entries, and a server's resident memory grows for
    hours (BENCHMARKS.md, "Soak"). A decode step's few shapes stay within 64, the most
    recently used. Both are read when the first primitive is made; a user's value wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))


def cuda_wait_mode() -> str:
    mode = os.environ.get("MINISGL_CUDA_WAIT", "thread")
    if mode not in ("thread", "poll"):
        raise ValueError(f"MINISGL_CUDA_WAIT={mode!r}: use thread or poll")
    return mode


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim). NOTE: glibc keeps
    what loading the weights freed (a checkpoint's decoded blocks: a few MB per expert, above
    its first mmap threshold but below the one it moves to after the first large free) and a
    large step's activations in the process, where neither the KV pool's sizing from
    `available` memory nor anything outside sees it, and a load's peak would grow with the
    layer count."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime torch loaded (Linux), else None."""
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps
                        if any(name in line for name in ("libgomp", "libiomp", "libomp")))
        return ctypes.CDLL(path).omp_set_num_threads
    except (OSError, StopIteration, AttributeError):
        return None


@contextlib.contextmanager
def no_openmp_on_this_thread() -> Iterator[None]:
    """Run this thread's torch ops serially (an OpenMP team of one) inside the block: the event
    loop's thread, while the engine thread serves. NOTE: one op there big enough to go parallel
    gives this thread its own OpenMP team; with more OpenMP threads than cores libgomp stops
    spinning between parallel regions, and every later CPU engine step runs slower for the
    rest of the process (BENCHMARKS.md, "Overlap mode at 2 streams")."""
    import torch

    setter = _omp_set_num_threads()
    if setter is None:
        yield
        return
    before = torch.get_num_threads()  # NOTE: also runs torch's per-thread lazy init first
    setter(1)
    try:
        yield
    finally:
        setter(before)

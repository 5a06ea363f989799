"""Where forwards run, and how the scheduler awaits them without blocking the event loop.

CPU: one worker thread runs submitted forwards in order (torch ops release the GIL, so the
event loop keeps running). GPU: forwards are queued on a dedicated CUDA stream and a recorded
event marks the host copy of the sampled tokens as done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import queue
import threading
from typing import Any, Callable, Iterator

import torch

from minisgl.distributed.context import bind_thread, tp_context


class EngineFailed(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run any more."""


class Completion:
    """Awaitable result of a launched forward."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    async def wait(self) -> Any:
        return await asyncio.wrap_future(self._future)

    async def wait_unless(self, failure: asyncio.Future) -> Any:
        """Like `wait`, but raise EngineFailed(failure's message) as soon as `failure`
        completes: a forward stuck in a collective with a dead rank must not hold the loop."""
        future = asyncio.wrap_future(self._future)
        if not future.done():
            await asyncio.wait((future, failure), return_when=asyncio.FIRST_COMPLETED)
        if future.done():
            return future.result()
        future.cancel()  # NOTE: detaches us; the engine thread settles the forward on its own
        raise EngineFailed(failure.result())

    def result(self) -> Any:
        return self._future.result()


class CpuStream:
    """The engine thread. NOTE: all of an engine's parallel torch work (loading, prepacking,
    forwards) runs here: a second thread using OpenMP makes a second thread pool, and with more
    pool threads than cores libgomp stops spinning between parallel regions, which cost ~35%
    per decode step at batch 1 on 2 cores."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="minisgl-engine")

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread and wait for its result (set-up work)."""
        return self._pool.submit(fn).result()

    def bind(self, binding: tuple[Any, Any]) -> None:
        """(TPInfo, group) that the engine thread's layers use (tp > 1)."""
        self.call(lambda: bind_thread(*binding))

    def launch(self, fn: Callable[[], Any]) -> Completion:
        return Completion(self._pool.submit(_in_inference_mode, fn))

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


class CudaStream:
    """Runs `fn` now on the engine stream (it only enqueues kernels) and completes when its
    recorded event fires. A waiter thread blocks on events in launch order."""

    def __init__(self, device: torch.device, binding: tuple[Any, Any] | None = None) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self._binding = binding
        self._events: queue.SimpleQueue[tuple[Any, Any, concurrent.futures.Future] | None]
        self._events = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait_events, daemon=True,
                                        name="minisgl-cuda-waiter")
        self._waiter.start()

    def launch(self, fn: Callable[[], Any]) -> Completion:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.stream.wait_stream(torch.cuda.current_stream())
        if self._binding is not None:  # fn runs on the caller's thread: bind it for the call
            with tp_context(*self._binding):
                return self._launch(fn, future)
        return self._launch(fn, future)

    def _launch(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> Completion:
        with torch.cuda.stream(self.stream), torch.inference_mode():
            output = fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events.put((event, output, future))
        return Completion(future)

    def _wait_events(self) -> None:
        while (item := self._events.get()) is not None:
            event, output, future = item
            try:
                event.synchronize()
                future.set_result(output)
            except BaseException as exc:  # a device error surfaces in the awaiting task
                future.set_exception(exc)

    def close(self, wait: bool = True) -> None:
        self._events.put(None)
        self._waiter.join(timeout=5 if wait else 0)


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
    """Run this thread's torch ops serially (OpenMP team of one) inside the block: the event
    loop's thread, while the engine thread serves. NOTE: one op there big enough to go parallel
    gives this thread its own OpenMP team; with more OpenMP threads than cores libgomp stops
    spinning between parallel regions, and every later CPU engine step ran ~1.5x slower, for
    the rest of the process (BENCHMARKS.md, "overlap mode at 2 streams")."""
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


def _in_inference_mode(fn: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return fn()


def create_stream(device: torch.device, binding: tuple[Any, Any] | None = None,
                  wait: str = "thread") -> Any:
    """`wait` (CUDA): "thread" completes forwards from a waiter thread, "poll" polls their
    events from the event loop (minisgl.engine.cuda_events). On an H100 the waiter thread gave
    8-17% more offline throughput; see BENCHMARKS.md for both measurements."""
    if device.type != "cuda":
        stream = CpuStream()
        if binding is not None:
            stream.bind(binding)
        return stream
    if wait == "poll":
        from minisgl.engine.cuda_events import PollingCudaStream
        return PollingCudaStream(device, binding)
    if wait != "thread":
        raise ValueError(f"unknown CUDA wait mode {wait!r} (thread or poll)")
    return CudaStream(device, binding)

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


PROBE_SECONDS = 2.5e-4


class Completion:
    """Awaitable result of a launched forward.

    `ready` (CUDA: the recorded event's `query`) is a second way to see the forward done; the
    awaiting coroutine probes it every PROBE_SECONDS while the future is pending. NOTE: the
    waiter thread needs the GIL to complete the future, and a loop that runs Python between
    its GIL-releasing epoll calls takes the GIL back before the woken thread can. CPython
    forces a hand-over after 5 ms only if no switch happened meanwhile, so the thread can wait
    hundreds of milliseconds (the convoy effect; BENCHMARKS.md, "Awaiting the copy-done
    event"). The probe bounds that delay by PROBE_SECONDS."""

    def __init__(self, future: concurrent.futures.Future,
                 ready: Callable[[], bool] | None = None, output: Any = None) -> None:
        self._future = future
        self._ready, self._output = ready, output

    async def wait(self) -> Any:
        return await self._wait(None)

    async def wait_unless(self, failure: asyncio.Future) -> Any:
        """Like `wait`, but raise EngineFailed(failure's message) as soon as `failure`
        completes: a forward stuck in a collective with a dead rank must not hold the loop."""
        return await self._wait(failure)

    async def _wait(self, failure: asyncio.Future | None) -> Any:
        future = asyncio.wrap_future(self._future)
        pending = {future} if failure is None else {future, failure}
        timeout = None if self._ready is None else PROBE_SECONDS
        while not future.done():
            if failure is not None and failure.done():
                future.cancel()  # NOTE: detaches us; the engine settles the forward on its own
                raise EngineFailed(failure.result())
            if self._ready is not None and self._ready():
                return self._output  # the waiter thread completes its future later, unseen
            await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return future.result()

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


class EventWaiter:
    """A thread that blocks on recorded events in launch order (no GIL held while it blocks)
    and completes each one's future with its output."""

    def __init__(self, name: str = "minisgl-cuda-waiter") -> None:
        self._events: queue.SimpleQueue[tuple[Any, Any, concurrent.futures.Future] | None]
        self._events = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def completion(self, event: Any, output: Any, probe: bool = True) -> Completion:
        """`output` once `event` fires; `probe=False` leaves the waiter thread as the only
        signal (the benchmark's baseline)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._events.put((event, output, future))
        return Completion(future, event.query if probe else None, output)

    def _run(self) -> None:
        while (item := self._events.get()) is not None:
            event, output, future = item
            try:
                event.synchronize()
                future.set_result(output)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled: its awaiting task gave up on the engine (EngineFailed)
            except BaseException as exc:  # a device error surfaces in the awaiting task
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(exc)

    def close(self, wait: bool = True) -> None:
        self._events.put(None)
        self._thread.join(timeout=5 if wait else 0)


class CudaStream:
    """Runs `fn` now on the engine stream (it only enqueues kernels) and completes when its
    recorded event fires: the waiter thread signals it, and the awaiting coroutine also probes
    the event (see Completion)."""

    def __init__(self, device: torch.device, binding: tuple[Any, Any] | None = None) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self._binding = binding
        self._waiter = EventWaiter()

    def launch(self, fn: Callable[[], Any]) -> Completion:
        self.stream.wait_stream(torch.cuda.current_stream())
        if self._binding is not None:  # fn runs on the caller's thread: bind it for the call
            with tp_context(*self._binding):
                return self._launch(fn)
        return self._launch(fn)

    def _launch(self, fn: Callable[[], Any]) -> Completion:
        with torch.cuda.stream(self.stream), torch.inference_mode():
            output = fn()
            event = torch.cuda.Event()
            event.record(self.stream)
        return self._waiter.completion(event, output)

    def close(self, wait: bool = True) -> None:
        self._waiter.close(wait)


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

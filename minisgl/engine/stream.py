"""Where forwards run, the engine stream, and how the scheduler task awaits one: a launched
forward is a `Completion`.

CPU (`CpuStream`): one worker thread runs submitted forwards in order (torch ops release the
GIL, so the event loop keeps running). CUDA (`CudaStream`): forwards are queued on a dedicated
CUDA stream and a recorded event marks the host copy of the sampled tokens, awaited one of two
ways:
- waiter thread (the default): a thread blocks in `event.synchronize()` (no GIL held), then
  completes a future; the awaiting coroutine also probes `event.query()` (see Completion).
- polling (`poll=True`, MINISGL_CUDA_WAIT=poll): the awaiting coroutine calls `event.query()`
  (no sync) and yields with `asyncio.sleep(0)` while the event is young, then backs off to
  short sleeps. No thread and no cross-thread wake-up; it costs loop iterations meanwhile.

`minisgl/bench/event_waits.py` measures both against a blocking synchronize.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from typing import Any, Callable

import torch

from minisgl.distributed.context import tp_context
from minisgl.errors import EngineFailed

PROBE_SECONDS = 2.5e-4


class Completion:
    """Completed by whoever runs the forward (the engine thread, or the CUDA waiter thread).

    NOTE: `ready` (CUDA: the recorded event's `query`) is a second way to see the forward done,
    probed every PROBE_SECONDS while the future is pending: a busy event loop can keep a waiter
    thread from getting the GIL back long after its event fired (BENCHMARKS.md, "Awaiting the
    copy-done event")."""

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
    pool threads than cores libgomp stops spinning between parallel regions."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="minisgl-engine")

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread and wait for its result (set-up work)."""
        return self._pool.submit(fn).result()

    def launch(self, fn: Callable[[], Any]) -> Completion:
        return Completion(self._pool.submit(_in_inference_mode, fn))

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


def _in_inference_mode(fn: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return fn()


SPIN_SECONDS = 2e-3  # poll every loop iteration for this long ...
MAX_SLEEP_SECONDS = 1e-3  # ... then sleep between polls, doubling up to this


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


async def wait_event(event: Any, spin_s: float = SPIN_SECONDS,
                     max_sleep_s: float = MAX_SLEEP_SECONDS,
                     failure: asyncio.Future | None = None) -> int:
    """Return once `event.query()` is true; the number of polls it took. Raises EngineFailed
    if `failure` completes first (see Completion.wait_unless)."""
    polls, delay = 0, 5e-5
    started = time.perf_counter()
    while not event.query():
        if failure is not None and failure.done():
            raise EngineFailed(failure.result())
        polls += 1
        if time.perf_counter() - started < spin_s:
            await asyncio.sleep(0)
        else:
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_sleep_s)
    return polls


class PolledCompletion:
    """Same interface as Completion, completed by polling the recorded event."""

    def __init__(self, event: torch.cuda.Event, output: Any) -> None:
        self._event, self._output = event, output

    def done(self) -> bool:
        return self._event.query()

    async def wait(self) -> Any:
        await wait_event(self._event)
        return self._output

    async def wait_unless(self, failure: asyncio.Future) -> Any:
        await wait_event(self._event, failure=failure)
        return self._output

    def result(self) -> Any:
        self._event.synchronize()
        return self._output


class CudaStream:
    """Runs `fn` now on the engine stream (it only enqueues kernels) and completes when the
    event recorded after it fires (`poll`: by polling it, else through the waiter thread)."""

    def __init__(self, device: torch.device, binding: tuple[Any, Any] | None = None,
                 poll: bool = False) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self._binding = binding
        self._waiter = None if poll else EventWaiter()

    def launch(self, fn: Callable[[], Any]) -> Completion | PolledCompletion:
        self.stream.wait_stream(torch.cuda.current_stream())
        with contextlib.ExitStack() as scope:
            if self._binding is not None:  # fn runs on the caller's thread: bind it for the call
                scope.enter_context(tp_context(*self._binding))
            with torch.cuda.stream(self.stream), torch.inference_mode():
                output = fn()
                event = torch.cuda.Event()
                event.record(self.stream)
        if self._waiter is None:
            return PolledCompletion(event, output)
        return self._waiter.completion(event, output)

    def close(self, wait: bool = True) -> None:
        if self._waiter is not None:
            self._waiter.close(wait)

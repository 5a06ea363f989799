"""The CUDA engine stream, and the two ways the scheduler task awaits a forward on it.

- waiter thread (the default): a thread blocks in `event.synchronize()` (no GIL held), then
  completes a future; the awaiting coroutine also probes `event.query()` (see Completion).
- polling (`poll=True`, MINISGL_CUDA_WAIT=poll): the awaiting coroutine calls `event.query()`
  (no sync) and yields with `asyncio.sleep(0)` while the event is young, then backs off to
  short sleeps. No thread and no cross-thread wake-up; it costs loop iterations meanwhile.

`scripts/event_waits.py` measures both against a blocking synchronize.
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
from minisgl.engine.completion import Completion
from minisgl.errors import EngineFailed

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


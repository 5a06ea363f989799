"""The awaitable result of a launched forward."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

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

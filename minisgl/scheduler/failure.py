"""The engine's failure, seen on the event loop.

A tensor-parallel rank that dies is noticed by the engine's monitor thread; the bridge hands
its message to the loop, where `future` completes with it and `wake` runs (the scheduler's
idle wait ends). Every loop-side reader (the scheduler, the HTTP server) shares this future.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from minisgl.engine import Engine


class FailureBridge:
    def __init__(self, engine: Engine, wake: Callable[[], None]) -> None:
        self.engine, self.wake = engine, wake
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[str] = self.loop.create_future()
        engine.add_failure_listener(self._on_failure)  # NOTE: at once if it already failed

    def _on_failure(self, message: str) -> None:  # the monitor thread
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._settle, message)

    def _settle(self, message: str) -> None:
        if not self.future.done():
            self.future.set_result(message)
        self.wake()

    def close(self) -> None:
        self.engine.remove_failure_listener(self._on_failure)

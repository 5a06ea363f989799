"""The engine's failure, seen on an event loop.

A tensor-parallel rank that dies is noticed by a monitor thread (distributed.worker); the watch
hands its message to the loop, where `future` completes with it. Every reader on that loop (the
scheduler, the server) awaits this one future.
"""

from __future__ import annotations

import asyncio
from typing import Callable

Listener = Callable[[str], None]


class FailureWatch:
    def __init__(self, add_listener: Callable[[Listener], None],
                 remove_listener: Callable[[Listener], None]) -> None:
        """Call on the loop; `add_listener` calls its callback at once if already failed."""
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[str] = self.loop.create_future()
        self._remove_listener = remove_listener
        add_listener(self._on_failure)

    def _on_failure(self, message: str) -> None:  # the monitor thread, or the caller's
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._settle, message)

    def _settle(self, message: str) -> None:
        if not self.future.done():
            self.future.set_result(message)

    def close(self) -> None:
        self._remove_listener(self._on_failure)

"""The engine's failure, seen on an event loop; and a step that fails on purpose.

A tensor-parallel rank that dies is noticed by a monitor thread (distributed.worker); the watch
hands its message to the loop, where `future` completes with it. Every reader on that loop (the
scheduler, the server) awaits this one future.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from minisgl.distributed.worker import TPWorkers


class FailureWatch:
    def __init__(self, workers: TPWorkers | None, failed: str | None) -> None:
        """Call on the loop. Without workers (tp 1, or after shutdown) the future completes at
        once with `failed` if set, else never."""
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[str] = self.loop.create_future()
        self.workers = workers
        if workers is not None:
            workers.add_listener(self._on_failure)  # NOTE: calls back at once if already failed
        elif failed is not None:
            self.future.set_result(failed)

    def _on_failure(self, message: str) -> None:  # the monitor thread, or the caller's
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._settle, message)

    def _settle(self, message: str) -> None:
        if not self.future.done():
            self.future.set_result(message)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.remove_listener(self._on_failure)


class InjectedFault(RuntimeError):
    pass


class FaultAfterSteps:
    """A step function that raises InjectedFault on its call `steps` + 1, as a bug inside a
    step would (MINISGL_FAULT_AFTER_STEPS: the fault tests' hook)."""

    def __init__(self, step: Callable[..., Any], steps: int) -> None:
        self.step, self.left = step, steps

    def __call__(self, *args: Any) -> Any:
        if self.left == 0:
            raise InjectedFault("a fault injected into the step (MINISGL_FAULT_AFTER_STEPS)")
        self.left -= 1
        return self.step(*args)

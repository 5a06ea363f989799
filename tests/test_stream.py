"""How the scheduler task awaits a launched forward: the waiter thread and the event probe of
`minisgl.engine.stream.Completion`, with stand-in events on CPU (the same code runs on CUDA
events in tests/test_gpu.py). The timing side (how late the thread alone is under a busy loop)
is `python -m minisgl.bench gpu events --device cpu`, recorded in BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from minisgl.engine.stream import Completion, EventWaiter
from minisgl.errors import EngineFailed


class StandInEvent:
    """`query` and `synchronize` driven by the test: `fired` is what query reports, and
    synchronize blocks (without the GIL) until `release` is set, then raises `error` if any."""

    def __init__(self, fired: bool = False, error: BaseException | None = None,
                 query_error: BaseException | None = None) -> None:
        self.fired, self.error, self.query_error = fired, error, query_error
        self.release = threading.Event()

    def query(self) -> bool:
        if self.query_error is not None:
            raise self.query_error
        return self.fired

    def synchronize(self) -> None:
        self.release.wait()
        if self.error is not None:
            raise self.error


def settle(completion: Completion) -> Any:
    """Await `completion` (30 s bound: a dead waiter thread fails the test, not hangs it)."""
    return asyncio.run(asyncio.wait_for(completion.wait(), 30))


@pytest.fixture
def waiter():
    waiter = EventWaiter("test-waiter")
    yield waiter
    waiter.close()


def test_probe_completes_while_the_waiter_thread_is_held_up(waiter: EventWaiter) -> None:
    """The thread is stuck (as when it cannot get the GIL back): the probe still completes."""
    event = StandInEvent(fired=True)
    try:
        assert settle(waiter.completion(event, "tokens")) == "tokens"
    finally:
        event.release.set()


def test_waiter_thread_completes_when_the_probe_never_fires(waiter: EventWaiter) -> None:
    event = StandInEvent(fired=False)
    event.release.set()
    assert settle(waiter.completion(event, "tokens")) == "tokens"


def test_in_launch_order_and_blocking_result(waiter: EventWaiter) -> None:
    events = [StandInEvent() for _ in range(4)]
    completions = [waiter.completion(event, i) for i, event in enumerate(events)]
    for event in events:
        event.release.set()
    assert [c.result() for c in completions] == list(range(4))

    async def awaited() -> list[int]:
        return [await c.wait() for c in completions]
    assert asyncio.run(awaited()) == list(range(4))


def test_device_errors_reach_the_awaiting_task(waiter: EventWaiter) -> None:
    failed_sync = StandInEvent(error=RuntimeError("illegal memory access"))
    failed_sync.release.set()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        settle(waiter.completion(failed_sync, None))

    failed_query = StandInEvent(query_error=RuntimeError("device-side assert"))
    try:
        with pytest.raises(RuntimeError, match="device-side assert"):
            settle(waiter.completion(failed_query, None))
    finally:
        failed_query.release.set()
    # the thread survived both and still completes later events
    ok = StandInEvent()
    ok.release.set()
    assert settle(waiter.completion(ok, "after")) == "after"


def test_wait_unless_raises_when_the_engine_fails(waiter: EventWaiter) -> None:
    event = StandInEvent(fired=False)

    async def run() -> None:
        failure = asyncio.get_running_loop().create_future()
        completion = waiter.completion(event, None)
        asyncio.get_running_loop().call_later(0.01, failure.set_result, "rank 1 died")
        await completion.wait_unless(failure)

    try:
        with pytest.raises(EngineFailed, match="rank 1 died"):
            asyncio.run(run())
    finally:
        event.release.set()
    # the abandoned (cancelled) completion does not kill the thread
    ok = StandInEvent()
    ok.release.set()
    assert settle(waiter.completion(ok, "after")) == "after"

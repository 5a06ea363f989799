"""Where forwards run, and how the scheduler awaits them without blocking the event loop.

CPU: one worker thread runs submitted forwards in order (torch ops release the GIL, so the
event loop keeps running). GPU: forwards are queued on a dedicated CUDA stream and a recorded
event marks the host copy of the sampled tokens as done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any, Callable

import torch


class Completion:
    """Awaitable result of a launched forward."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    async def wait(self) -> Any:
        return await asyncio.wrap_future(self._future)

    def result(self) -> Any:
        return self._future.result()


class CpuStream:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minisgl-engine")

    def launch(self, fn: Callable[[], Any]) -> Completion:
        return Completion(self._pool.submit(_in_inference_mode, fn))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class CudaStream:
    """Runs `fn` now on the engine stream (it only enqueues kernels) and completes when its
    recorded event fires. A waiter thread blocks on events in launch order."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self._events: queue.SimpleQueue[tuple[Any, Any, concurrent.futures.Future] | None]
        self._events = queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait_events, daemon=True,
                                        name="minisgl-cuda-waiter")
        self._waiter.start()

    def launch(self, fn: Callable[[], Any]) -> Completion:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.stream.wait_stream(torch.cuda.current_stream())
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

    def close(self) -> None:
        self._events.put(None)
        self._waiter.join(timeout=5)


def _in_inference_mode(fn: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return fn()


def create_stream(device: torch.device) -> CpuStream | CudaStream:
    return CudaStream(device) if device.type == "cuda" else CpuStream()

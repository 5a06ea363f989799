"""How late the scheduler learns that a CUDA forward is done, by the ways it can await it: a
blocking `event.synchronize()` on the loop thread (the latency floor), the waiter thread alone,
the waiter thread with the event probe (the default), and polling from the event loop.

`python -m minisgl.bench gpu events` runs it on a GPU; `--device cpu` measures the thread
hand-off alone, with stand-in events (BENCHMARKS.md, "Awaiting the copy-done event")."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, Callable

import torch

from minisgl.engine.stream import EventWaiter, wait_event

WAIT_MODES = ("sync", "thread", "thread+probe", "poll")


class DeadlineEvent:
    """CPU stand-in for a recorded CUDA event that fires `seconds` after it is made: `query`
    does not block, and `synchronize` sleeps without the GIL, like cudaEventSynchronize."""

    def __init__(self, seconds: float) -> None:
        self._deadline = time.perf_counter() + seconds

    def query(self) -> bool:
        return time.perf_counter() >= self._deadline

    def synchronize(self) -> None:
        left = self._deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)


def _cycles_per_ms(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep (a spin kernel of N clock cycles) against CUDA events."""
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        return 50_000_000 / start.elapsed_time(end)


def _event_maker(device: torch.device) -> Callable[[float], Any]:
    """duration_ms -> an event that fires that long from now: a spin kernel and the event
    recorded after it on a side stream (CUDA), or a DeadlineEvent (CPU)."""
    if device.type != "cuda":
        return lambda duration_ms: DeadlineEvent(duration_ms * 1e-3)
    per_ms, side = _cycles_per_ms(device), torch.cuda.Stream(device=device)

    def make(duration_ms: float) -> torch.cuda.Event:
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(per_ms * duration_ms))
            event = torch.cuda.Event()
            event.record(side)
        return event
    return make


async def _measure(mode: str, make_event: Callable[[float], Any], duration_ms: float,
                   iters: int, busy_us: float) -> dict[str, Any]:
    waiter = EventWaiter("bench-waiter") if mode.startswith("thread") else None
    ticks, stop = 0, False

    async def background() -> None:  # other coroutines' work: busy_us of Python, then yield
        nonlocal ticks
        while not stop:
            end = time.perf_counter() + busy_us * 1e-6
            while time.perf_counter() < end:
                pass
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(background()) if busy_us > 0 else None
    await asyncio.sleep(0)
    latencies = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        for _ in range(iters):
            t0 = time.perf_counter()
            event = make_event(duration_ms)
            if mode == "sync":
                event.synchronize()  # blocks the loop: the latency floor
            elif mode == "poll":
                await wait_event(event)
            else:
                await waiter.completion(event, None, probe=mode == "thread+probe").wait()
            latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0)
    finally:
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        stop = True
        if task is not None:
            await task
        if waiter is not None:
            waiter.close()
    latencies.sort()
    return {"mode": mode, "median_ms": statistics.median(latencies) * 1e3,
            "p90_ms": latencies[int(0.9 * (len(latencies) - 1))] * 1e3,
            "cpu_ms_per_wait": cpu / iters * 1e3,
            "background_ticks_per_s": ticks / wall if busy_us > 0 else None}


def benchmark_waiters(device: torch.device | str | None = None,
                      durations_ms: tuple[float, ...] = (0.2, 1.0, 5.0, 20.0), iters: int = 50,
                      busy_us: float = 0.0) -> list[dict[str, Any]]:
    """For each step duration, every WAIT_MODES entry: blocking sync (the floor), the waiter
    thread alone, the waiter thread with the event probe (CudaStream), polling. Rows have
    median/p90 latency from launch to the coroutine resuming, overhead over the floor, process
    CPU time per wait (all threads) and, with busy_us > 0, the background coroutine's ticks/s
    (a busy loop: how much scheduler/handler work still gets done while waiting). On a CPU
    device the events are DeadlineEvent stand-ins: the thread hand-off is measured, no GPU."""
    device = torch.device(device or "cuda")
    make_event = _event_maker(device)
    rows = []
    for duration in durations_ms:
        floor = None
        for mode in WAIT_MODES:
            row = asyncio.run(_measure(mode, make_event, duration, iters, busy_us))
            floor = row["median_ms"] if mode == "sync" else floor
            row.update(gpu_ms=duration, busy_us=busy_us,
                       overhead_us=(row["median_ms"] - floor) * 1e3)
            rows.append(row)
    return rows

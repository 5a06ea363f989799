"""Where forwards run: the engine stream.

CPU: one worker thread runs submitted forwards in order (torch ops release the GIL, so the
event loop keeps running). CUDA: forwards are queued on a dedicated CUDA stream
(`engine.cuda_stream`) and a recorded event marks the host copy of the sampled tokens.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import torch

from minisgl.engine.completion import Completion


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


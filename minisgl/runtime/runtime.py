"""The runtime: the engine, its scheduler and the request manager, built from ServerArgs. The
HTTP server and the offline `LLM` hold this object and reach nothing below it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from minisgl.args import ServerArgs
from minisgl.engine import Engine, EngineConfig
from minisgl.env import quiet_tokenizer_threads
from minisgl.runtime.manager import RequestManager
from minisgl.runtime.tokenizer import Tokenizer
from minisgl.scheduler import Scheduler, SchedulerConfig


class Runtime:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        quiet_tokenizer_threads()  # NOTE: before the engine spawns its TP workers
        self.engine = Engine(args.pick(EngineConfig))
        try:
            self.tokenizer = Tokenizer.load(args.tokenizer_path or self.engine.model_path)
            self.scheduler = Scheduler(self.engine, args.pick(SchedulerConfig),
                                       lambda outputs: self.requests.deliver(outputs))
            self.requests = RequestManager(self.scheduler, self.tokenizer)
        except BaseException:
            self.engine.shutdown()
            raise

    async def start(self) -> None:
        await self.requests.start()

    async def stop(self) -> None:
        """Abort what runs, stop the scheduler, then the engine (and its TP workers)."""
        await self.requests.stop()
        self.engine.shutdown()

    # ---- what the front ends ask -------------------------------------------------------------

    @property
    def model_path(self) -> Path:
        return self.engine.model_path

    @property
    def tokenizer_path(self) -> str | None:
        if self.tokenizer is None:
            return None
        return self.args.tokenizer_path or str(self.engine.model_path)

    @property
    def context_len(self) -> int:
        return self.scheduler.context_len

    @property
    def max_sequence_len(self) -> int:
        """The most tokens (prompt + output) one sequence can have: context and KV pool."""
        return min(self.scheduler.context_len, self.scheduler.limits.pool_tokens)

    @property
    def running(self) -> bool:
        return self.requests.running

    @property
    def failed(self) -> str | None:
        """Why the engine cannot serve any more (a tensor-parallel rank died), else None."""
        return self.scheduler.engine_failed

    async def wait_failed(self) -> str:
        """Returns the reason once the engine has failed (never on tp 1). The HTTP server
        races this against its stop signal, answers /health with 503, then exits."""
        return await asyncio.shield(self.scheduler.failure())

    @property
    def idle(self) -> bool:
        return not self.requests.handles and self.scheduler.idle

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests run."""
        return not self.requests.handles and self.scheduler.flush_cache()

    def state(self) -> dict[str, Any]:
        return self.scheduler.state()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

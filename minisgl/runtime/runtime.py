"""The runtime: the engine, its scheduler and the request manager, built from ServerArgs. The
HTTP server and the offline `LLM` hold this object and reach nothing below it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from minisgl.args import ServerArgs
from minisgl.engine import Engine, EngineConfig
from minisgl.env import bound_onednn_caches, quiet_tokenizer_threads
from minisgl.errors import InvalidRequest
from minisgl.flag_checks import HARMONY_PARSER
from minisgl.grammar import create_grammar_backend
from minisgl.models import model_name
from minisgl.runtime.images import image_limits
from minisgl.runtime.manager import RequestManager
from minisgl.runtime.metrics import Metrics
from minisgl.runtime.request_log import RequestLog
from minisgl.runtime.tokenizer import Tokenizer
from minisgl.scheduler import Scheduler, SchedulerConfig
from minisgl.scheduler.lora import add_adapter

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        quiet_tokenizer_threads()  # NOTE: before the engine spawns its TP workers
        bound_onednn_caches()
        engine_config = args.pick(EngineConfig)
        if args.is_embedding:  # NOTE: it never decodes, so decode graphs would be dead weight
            engine_config = replace(engine_config, disable_cuda_graph=True)
        self.engine = Engine(engine_config)
        if (self.engine.arch.harmony and args.reasoning_parser is None
                and args.tool_call_parser == "hermes"):
            logger.info("%s answers in the harmony format: --reasoning-parser gpt-oss "
                        "--tool-call-parser gpt-oss", self.engine.arch.architecture)
            self.args = args = replace(args, reasoning_parser=HARMONY_PARSER,
                                       tool_call_parser=HARMONY_PARSER)
        try:
            self.tokenizer = Tokenizer.load(args.tokenizer_path or self.engine.model_path)
            template = args.chat_template_text()
            if template is not None and self.tokenizer is not None:
                self.tokenizer.set_chat_template(template)
            self.scheduler = Scheduler(self.engine, args.pick(SchedulerConfig))
            grammar = create_grammar_backend(
                args.grammar_backend, self.tokenizer.hf if self.tokenizer else None,
                self.engine.arch.vocab_size,
                any_whitespace=not args.constrained_json_disable_any_whitespace)
            # the model's names: answers and metrics report the first
            self.served_names = args.served_model_names or [model_name(args.model_path)]
            self.model_name = self.served_names[0]
            self.requests = RequestManager(self.scheduler, self.tokenizer, grammar,
                                           Metrics(self.model_name), self._request_log(),
                                           image_limits(args))
            for name, path, pinned in args.lora_adapters():
                try:
                    add_adapter(self.scheduler.adapters, self.engine.lora, name, path, pinned)
                except InvalidRequest as exc:  # NOTE: bad start-up input: one line, exit 2
                    raise ValueError(f"--lora-paths: {exc}") from None
        except BaseException:
            self.engine.shutdown()
            raise

    def _request_log(self) -> RequestLog | None:
        if not self.args.log_requests:
            return None
        hf = self.tokenizer.hf if self.tokenizer is not None else None
        decode = (lambda ids: hf.decode(ids, skip_special_tokens=False)) if hf else None
        return RequestLog(self.args.log_requests_level, self.args.log_requests_format, decode)

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
    def running(self) -> bool:
        return self.requests.running

    @property
    def failed(self) -> str | None:
        """Why this runtime cannot serve any more (a tensor-parallel rank died, or the
        scheduler stopped on an error), else None."""
        return self.engine.failed or self.requests.crash

    async def wait_failed(self) -> str:
        """Returns `failed` once it is set. The HTTP server races this against its stop
        signal, answers /health with 503, then exits non-zero."""
        waits = {asyncio.ensure_future(asyncio.shield(self.engine.failure())),
                 asyncio.ensure_future(self.requests.wait_crashed())}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return done.pop().result()

    @property
    def idle(self) -> bool:
        return not self.requests.handles and self.scheduler.idle

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests run."""
        return not self.requests.handles and self.scheduler.flush_cache()

    def state(self) -> dict[str, Any]:
        return self.scheduler.state()

    # ---- LoRA adapters -----------------------------------------------------------------------

    def loaded_adapters(self) -> dict[str, str]:
        """name -> folder of every loaded LoRA adapter, in load order."""
        return {name: a.path for name, a in self.scheduler.adapters.by_name.items()}

    async def load_adapter(self, name: str, path: str, pinned: bool) -> None:
        """Raises InvalidRequest (LoRA off, a taken name, an adapter that cannot serve)."""
        await self.scheduler.load_adapter(name, path, pinned)

    async def unload_adapter(self, name: str) -> None:
        """New requests cannot name it at once; returns once its requests finished."""
        await self.scheduler.unload_adapter(name)

    def config_block(self) -> str:
        """resolved_config as lines of `section.name = value`."""
        return "\n".join(f"  {section}.{name} = {value}"
                         for section, values in self.resolved_config().items()
                         for name, value in values.items())

    def model_info(self) -> dict[str, Any]:
        """SGLang's /model_info fields."""
        arch = self.engine.arch
        return {"model_path": str(self.model_path), "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.model_name,
                "is_generation": not self.args.is_embedding,
                "model_type": arch.model_type, "architectures": [arch.architecture],
                "preferred_sampling_params": None, "weight_version": "default"}

    def resolved_config(self) -> dict[str, dict[str, Any]]:
        """What this server runs with, each value as resolved (the flags, then the device's, the
        model's and the memory's defaults for what they left open), in sections: printed at
        start as one block (`config_block`) and /server_info's `resolved`. The engine and
        scheduler sections are the frozen configs those layers read."""
        engine, scheduler, args = self.engine, self.scheduler, self.args
        arch, graphs = engine.arch, engine.runner.graph_runner
        model = {"path": str(self.model_path), "served_names": list(self.served_names),
                 "architecture": arch.architecture, "layers": arch.num_layers,
                 "context_length": self.context_len, "dtype": engine.config.dtype,
                 "quantization": engine.quantization, "tokenizer": self.tokenizer_path,
                 # what one decode token reads (a rank's share): the bandwidth figures' bytes
                 "decode_weight_bytes": engine.decode_weight_bytes,
                 "kv_bytes_per_token": engine.kv_pool.layout.bytes_per_token(
                     engine.kv_pool.cache_dtype)}
        in_model = {"model_path", "context_length", "dtype", "quantization"}
        return {
            "model": model,
            "engine": {**{k: v for k, v in dataclasses.asdict(engine.config).items()
                          if k not in in_model},
                       "kv_pool_tokens": scheduler.limits.pool_tokens,
                       "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs else []},
            "scheduler": dataclasses.asdict(scheduler.config),
            "server": {"host": args.host, "port": args.port, "api_key": bool(args.api_key),
                       "is_embedding": args.is_embedding,
                       "tool_call_parser": args.tool_call_parser,
                       "reasoning_parser": args.reasoning_parser,
                       "grammar_backend": args.grammar_backend},
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's /server_info: the flags, with the values the engine resolved (a router
        reads the model's name and the sizes from here), and the scheduler's state."""
        limits = self.scheduler.limits
        return {**self.args.to_dict(), "served_model_name": self.model_name,
                "model_path": str(self.model_path), "tp_size": self.engine.tp.size,
                "dp_size": 1, "max_running_requests": self.engine.max_running,
                "max_total_tokens": limits.pool_tokens,
                "max_total_num_tokens": limits.pool_tokens,
                "context_length": self.context_len, "page_size": self.engine.page_size,
                "chunked_prefill_size": self.scheduler.config.chunked_prefill_size,
                "resolved": self.resolved_config(), "internal_states": [self.state()]}

    def load(self) -> list[dict[str, int]]:
        """SGLang's /get_load: one entry per data-parallel rank (one here)."""
        state = self.state()
        return [{"dp_rank": 0, "num_reqs": state["num_running_reqs"] + state["num_waiting_reqs"],
                 "num_waiting_reqs": state["num_waiting_reqs"],
                 "num_tokens": state["kv_used_tokens"]}]

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

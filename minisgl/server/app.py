"""The HTTP app: SGLang's native endpoints and operations (the OpenAI ones are in
`openai_api`), behind the error, browser and API-key middlewares."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable

from aiohttp import web

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest, QueueFull
from minisgl.protocol.fields import UnknownFields
from minisgl.protocol.native import (GenerateStream, generate_results, parse_abort,
                                     parse_adapter_request, parse_generate)
from minisgl.protocol.openai_models import UnknownModel
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import Runtime
from minisgl.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from minisgl.scheduler import RequestSpec
from minisgl.server.dashboard import OPEN_PATHS as DASHBOARD_OPEN_PATHS, Dashboard
from minisgl.server.embeddings_api import EmbeddingsAPI
from minisgl.server.guard import AdapterFolders, Guard, Handler
from minisgl.server.http import (MAX_BODY, STREAM_WRITE_TIMEOUT, HTTPError, error_response,
                                 json_response, read_json, stream_response, too_large,
                                 wait_all)
from minisgl.server.openai_api import OpenAIAPI
from minisgl.server.responses_api import ResponsesAPI
from minisgl.server.timeline import Timeline
from minisgl.version import __version__

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # for aborted requests to deliver their last chunk
RETRY_AFTER = {"Retry-After": "1"}  # shutting down: another replica (or the restart) serves
HEALTH_GENERATE_TIMEOUT_S = 60.0


class Server:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.args, self.manager = runtime, runtime.args, runtime.requests
        args = self.args
        self.shutting_down = False
        self.tokens = TokenTexts(runtime.tokenizer)
        self.unknown_fields = UnknownFields()  # shared by every endpoint: each name logged once
        self.openai = OpenAIAPI(runtime, self.tokens, self.unknown_fields, self.ensure_ready)
        self.responses = ResponsesAPI(runtime, self.openai.model, self.tokens,
                                      self.unknown_fields, self.ensure_ready)
        self.embeddings = EmbeddingsAPI(runtime, self.openai.model, self.unknown_fields,
                                        self.ensure_ready)
        self.timeline = Timeline(runtime.state, self.manager.metrics)
        self.manager.metrics.watch_scheduler(runtime.state, self.timeline.gen_throughput)
        self.dashboard = Dashboard(runtime, self.timeline)
        self.guard = Guard(args.host, args.api_key, args.split_list(args.allowed_hosts),
                           args.split_list(args.cors_origins), DASHBOARD_OPEN_PATHS,
                           args.admin_api_key)
        self.adapter_folders = AdapterFolders(
            [*(args.lora_dirs or []),
             *(str(Path(path).resolve().parent) for _, path, _ in args.lora_adapters())])

    def build_app(self) -> web.Application:
        middlewares = [self.errors_middleware, self.guard.middleware]
        if self.embeddings.serves_embeddings:  # NOTE: it refuses the generation endpoints
            middlewares.append(self.embeddings.middleware)
        app = web.Application(client_max_size=self.args.max_request_bytes,
                              middlewares=middlewares)
        app[MAX_BODY] = self.args.max_request_bytes
        app[STREAM_WRITE_TIMEOUT] = self.args.stream_write_timeout
        app.on_response_prepare.append(self.guard.add_cors_headers)
        app.cleanup_ctx.append(self._timeline_sampling)
        app.add_routes([
            web.get("/health", self.health), web.post("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info), web.get("/model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.get("/server_info", self.server_info),
            web.get("/get_load", self.load),
            web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
            web.post("/abort_request", self.abort_request),
            web.get("/metrics", self.metrics),
            web.post("/generate", self.generate),
            *(web.post(f"{prefix}/{action}_lora_adapter", handler)
              for prefix in ("", "/v1") for action, handler in
              (("load", self.load_adapter), ("unload", self.unload_adapter))),
            *self.openai.routes(),
            *self.responses.routes(),
            *self.embeddings.routes(),
            *self.dashboard.routes(),
        ])
        return app

    async def _timeline_sampling(self, app: web.Application) -> AsyncIterator[None]:
        async with self.dashboard.sampling():
            yield

    # ---- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def errors_middleware(self, request: web.Request, handler: Handler
                                ) -> web.StreamResponse:
        """Every failure as {"error": {"message", "type", "code"}}."""
        try:
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.code, exc.headers)
        except UnknownModel as exc:
            return error_response(404, str(exc), "invalid_request_error", "model_not_found")
        except InvalidRequest as exc:
            return error_response(400, str(exc))
        except QueueFull as exc:
            return error_response(503, str(exc))
        except web.HTTPRequestEntityTooLarge:
            error = too_large(request)
            return error_response(error.status, error.message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, f"{exc.reason}: {request.method} {request.path}")
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal server error (see the server log)")

    def ensure_ready(self) -> None:
        if self.shutting_down:
            raise HTTPError(503, "the server is shutting down", headers=RETRY_AFTER)
        if not self.manager.running:
            raise HTTPError(503, "the scheduler is not running (see the server log)")

    # ---- SGLang-native generation ------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        req = parse_generate(await read_json(request), self.manager.max_sequences,
                             self.unknown_fields)
        handles = await self.manager.submit_prompts(req.prompts, req.stream)
        if req.stream:
            chunks = GenerateStream(req, self.tokens)
            return await stream_response(request, self.manager, handles, chunks.chunk)
        await wait_all(self.manager, handles)
        return json_response(generate_results(req, handles, self.tokens))

    # ---- operations --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.shutting_down:
            return error_response(503, "the server is shutting down", headers=RETRY_AFTER)
        if not self.manager.running:
            return error_response(503, "unhealthy: the scheduler stopped (see the server log)")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        self.ensure_ready()
        params = SamplingParams(max_new_tokens=1, temperature=0)
        [handle] = self.manager.submit([RequestSpec([0], params, f"health-{uuid.uuid4().hex}")])
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.manager.wait(handle), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return error_response(503, f"no token generated in {HEALTH_GENERATE_TIMEOUT_S} s")
        if len(handle.output_ids) != 1:
            return error_response(503, f"health generation ended with {handle.finish_reason}")
        return json_response({"status": "ok", "latency": time.perf_counter() - started})

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(self.runtime.model_info())

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response({**self.runtime.server_info(), "version": __version__})

    async def load(self, request: web.Request) -> web.Response:
        return json_response(self.runtime.load())

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.guard.check_admin(request, "flushing the cache")
        if not self.runtime.flush_cache():
            raise HTTPError(400, "cannot flush the cache while requests are running")
        logger.info("prefix cache flushed")
        return json_response({"success": True, "message": "cache flushed"})

    async def abort_request(self, request: web.Request) -> web.Response:
        abort = parse_abort(await read_json(request))
        if abort.rid is None:
            self.guard.check_admin(request, "aborting every request")
            rids = list(self.manager.handles)
            self.manager.abort_all("aborted by /abort_request")
            return json_response({"success": True, "aborted": rids})
        found = self.manager.abort(abort.rid, "aborted by /abort_request")
        return json_response({"success": found, "aborted": [abort.rid] if found else []})

    async def load_adapter(self, request: web.Request) -> web.Response:
        """SGLang's /load_lora_adapter (vLLM's /v1/load_lora_adapter alike)."""
        self.guard.check_admin(request, "loading an adapter")
        adapter = parse_adapter_request(await read_json(request), load=True)
        self.adapter_folders.check(adapter.path)
        return await self._adapter_result(
            self.runtime.load_adapter(adapter.name, adapter.path, adapter.pinned))

    async def unload_adapter(self, request: web.Request) -> web.Response:
        self.guard.check_admin(request, "unloading an adapter")
        adapter = parse_adapter_request(await read_json(request), load=False)
        return await self._adapter_result(self.runtime.unload_adapter(adapter.name))

    async def _adapter_result(self, change: Awaitable[None]) -> web.Response:
        """SGLang's LoRAUpdateResult: success, error_message, loaded_adapters."""
        try:
            await change
        except InvalidRequest as exc:
            return json_response({"success": False, "error_message": str(exc),
                                  "loaded_adapters": self.runtime.loaded_adapters(),
                                  "error": {"message": str(exc), "type": "BadRequestError",
                                            "code": 400}}, status=400)
        return json_response({"success": True, "error_message": "",
                              "loaded_adapters": self.runtime.loaded_adapters()})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.manager.metrics.render(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def drain(self, timeout: float, cut_short: asyncio.Event) -> None:
        """Refuse new requests (503, Retry-After) and wait until the running ones finished,
        `timeout` seconds passed or `cut_short` is set."""
        self.shutting_down = True
        running = len(self.manager.handles)
        logger.info("draining: new requests refused; %d running get up to %g s to finish",
                    running, timeout)
        deadline = time.monotonic() + timeout
        while (self.manager.handles and self.manager.running and not cut_short.is_set()
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        if self.manager.handles:
            logger.warning("%d requests still running are aborted", len(self.manager.handles))

    async def shutdown(self, runner: web.AppRunner) -> None:
        """Refuse new requests, abort the running ones (their clients get a last chunk with
        finish_reason abort), close the connections, stop the runtime."""
        self.shutting_down = True
        self.manager.abort_all("the server is shutting down")
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.manager.handles and self.manager.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await runner.cleanup()  # stops listening, lets handlers write their last chunk
        await self.runtime.stop()

"""The HTTP server: one event loop hosts aiohttp, the tokenizer/detokenizer and the scheduler.

`serve(args)` loads the model, starts the request manager, listens, prints one ready line and
runs until SIGINT/SIGTERM; then it refuses new requests, aborts the running ones (their
clients get a final chunk with finish_reason abort), closes connections and stops the manager.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
import uuid
from contextlib import aclosing
from typing import Any, Callable

from aiohttp import web

from minisgl import __version__
from minisgl.core import InvalidRequest, SamplingParams
from minisgl.engine import no_openmp_on_this_thread
from minisgl.scheduler import QueueFull, RequestSpec
from minisgl.server.guard import Guard, Handler
from minisgl.server.listen import bind, quiet_client_faults, start_sites
from minisgl.server.manager import ReqHandle, RequestManager
from minisgl.server.openai_api import OpenAIAPI
from minisgl.server.protocol import (
    MAX_BODY,
    HTTPError,
    check_bool,
    TokenTexts,
    error_response,
    generate_result,
    json_response,
    none_as,
    parse_generate,
    read_json,
    submit_all,
    too_large,
)
from minisgl.server.sse import DONE, encode_event, follow, open_stream, wait_all
from minisgl.server_args import ServerArgs

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # for aborted requests to deliver their last chunk
FAILURE_GRACE_S = 2.0  # after an engine failure, answer 503 this long before exiting
HEALTH_GENERATE_TIMEOUT_S = 60.0


class Server:
    def __init__(self, args: ServerArgs, manager: RequestManager) -> None:
        self.args, self.manager = args, manager
        self.shutting_down = False
        model_path = manager.engine.model_path
        self.model_name = args.served_model_name or args.model_path or model_path.name
        aliases = {str(model_path), *(name for name in (args.model_path,) if name)}
        self.tokens = TokenTexts(manager.tokenizer)
        self.openai = OpenAIAPI(manager, self.model_name, aliases, self.tokens,
                                self.ensure_ready)
        self.guard = Guard(args.host, args.api_key, args.split_list(args.allowed_hosts),
                           args.split_list(args.cors_origins))

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.args.max_request_bytes,
                              middlewares=[self.errors_middleware, self.guard.middleware])
        app[MAX_BODY] = self.args.max_request_bytes
        app.on_response_prepare.append(self.guard.add_cors_headers)
        app.add_routes([
            web.get("/health", self.health), web.post("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.get("/flush_cache", self.flush_cache), web.post("/flush_cache", self.flush_cache),
            web.post("/abort_request", self.abort_request),
            web.get("/metrics", self.metrics),
            web.post("/generate", self.generate),
            *self.openai.routes(),
        ])
        return app

    # ---- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def errors_middleware(self, request: web.Request, handler: Handler
                                ) -> web.StreamResponse:
        """Every failure as {"error": {"message", "type", "code"}}."""
        try:
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message, exc.type, exc.code)
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
            raise HTTPError(503, "the server is shutting down")
        if not self.manager.running:
            raise HTTPError(503, "the scheduler is not running (see the server log)")

    # ---- SGLang-native generation ------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        req = parse_generate(await read_json(request), self.args.max_sequences_per_request)
        tokens = self.tokens if req.text_in_logprobs else None
        handles = await submit_all(self.manager, req.prompts)
        if not req.stream:
            await wait_all(self.manager, handles)
            results = [generate_result(h, tokens) for h in handles]
            return json_response(results[0] if req.single else results)
        try:
            response = await open_stream(request)
        except BaseException:
            self._abort(handles, "the client disconnected")
            raise
        sent: dict[int, tuple[int, int, bool]] = {}
        try:
            async with aclosing(follow(self.manager, handles)) as updates:
                async for i, h in updates:
                    key = (len(h.output_ids), len(h.text), h.finished)
                    if sent.get(i) == key:
                        continue
                    sent[i] = key
                    chunk = generate_result(h, tokens)
                    if not req.single:
                        chunk["index"] = i
                    await response.write(encode_event(chunk))
            await response.write(DONE)
        except ConnectionResetError:
            pass  # the client went away; leaving `follow` aborted its requests
        return response

    def _abort(self, handles: list[ReqHandle], message: str) -> None:
        for h in handles:
            if not h.finished:
                self.manager.abort(h.rid, message)

    # ---- operations --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.shutting_down or not self.manager.running:
            return error_response(503, "unhealthy: shutting down or the scheduler stopped")
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
        path = str(self.manager.engine.model_path)
        tokenizer = (self.args.tokenizer_path or path) if self.manager.tokenizer else None
        return json_response({"model_path": path, "tokenizer_path": tokenizer,
                              "is_generation": True, "served_model_name": self.model_name})

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response({**self.args.to_dict(),
                              "internal_states": [self.manager.scheduler.state()],
                              "version": __version__})

    def _idle(self) -> bool:
        scheduler = self.manager.scheduler
        return not (self.manager.handles or scheduler.reqs or scheduler.to_release
                    or scheduler.has_work())

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self._idle():
            raise HTTPError(400, "cannot flush the cache while requests are running")
        self.manager.scheduler.cache.reset_cache()
        logger.info("prefix cache flushed")
        return json_response({"success": True, "message": "cache flushed"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if check_bool(none_as(body.get("abort_all"), False), "abort_all"):
            rids = list(self.manager.handles)
            self.manager.abort_all("aborted by /abort_request")
            return json_response({"success": True, "aborted": rids})
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise InvalidRequest("give rid (a string) or abort_all: true")
        found = self.manager.abort(rid, "aborted by /abort_request")
        return json_response({"success": found, "aborted": [rid] if found else []})

    async def metrics(self, request: web.Request) -> web.Response:
        text = self.manager.metrics.render(self.manager.scheduler.state())
        return web.Response(body=text.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---- lifecycle ---------------------------------------------------------------------------

    async def shutdown(self, runner: web.AppRunner) -> None:
        self.shutting_down = True
        self.manager.abort_all("the server is shutting down")
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.manager.handles and self.manager.running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await runner.cleanup()  # stops listening, lets handlers write their last chunk
        await self.manager.stop()


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def listen(server: Server, sockets: list[socket.socket]) -> tuple[web.AppRunner, int]:
    """Serve `server` on the bound sockets; returns the runner and the port."""
    debug = server.args.log_level == "debug"
    # NOTE: handler_cancellation makes a client that goes away cancel its handler, which
    # aborts its requests (RequestManager.updates); aiohttp leaves it off by default.
    runner = web.AppRunner(server.build_app(), handler_cancellation=True,
                           shutdown_timeout=SHUTDOWN_GRACE_S,
                           **({} if debug else {"access_log": None}))
    await runner.setup()
    try:
        port = await start_sites(runner, sockets)
    except OSError as exc:
        await runner.cleanup()
        raise ValueError(f"cannot listen on {server.args.host}: {exc.strerror}") from None
    return runner, port


async def run_server(args: ServerArgs) -> None:
    started = time.perf_counter()
    sockets = bind(args.host, args.port)  # a busy port is refused before the model loads
    quiet_client_faults()
    logger.info("loading model %s (dtype %s, device %s)", args.model_path or "(bundled SmolLM2)",
                args.dtype, args.device)
    try:
        manager = RequestManager(args)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    logger.info("model %s loaded in %.1f s", manager.engine.model_path,
                time.perf_counter() - started)
    await manager.start()
    server = Server(args, manager)
    try:
        runner, port = await listen(server, sockets)
    except ValueError:
        await manager.stop()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"minisgl ready: listening on {_url(args.host, port)}", flush=True)
    failed = asyncio.ensure_future(manager.wait_failed())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        logger.error("the engine failed (%s); exiting", failed.result())
        server.shutting_down = True  # /health answers 503 while probes notice
        await asyncio.wait({stopped}, timeout=FAILURE_GRACE_S)
    failed.cancel()
    stopped.cancel()
    logger.info("shutting down")
    await server.shutdown(runner)  # manager.stop: TP workers stopped, shared memory unlinked
    logger.info("stopped")
    if manager.failed is not None:
        raise SystemExit(1)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(args: ServerArgs) -> None:
    """Run the server until SIGINT/SIGTERM (uvloop when available)."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows
        run: Callable[[Any], Any] = asyncio.run
    else:
        run = uvloop.run
    # Until the loop takes the signals over (once the model is loaded), SIGTERM acts as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with no_openmp_on_this_thread():  # the event loop's thread leaves OpenMP to the engine
            run(run_server(args))
    except KeyboardInterrupt:
        logger.info("interrupted while loading")

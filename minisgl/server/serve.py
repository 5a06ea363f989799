"""`serve(args)`: bind the port, build the runtime, listen, print one ready line, and run until
a signal or a failure. SIGTERM drains (new requests get 503, running ones get
--shutdown-timeout to finish) and SIGINT aborts at once; both exit 0. A failure (a rank died,
the scheduler stopped on an error) turns /health 503, ends every request and exits 1."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from typing import Any, Callable

from aiohttp import web

from minisgl.args import ServerArgs
from minisgl.env import no_openmp_on_this_thread
from minisgl.runtime import Runtime
from minisgl.server.app import SHUTDOWN_GRACE_S, Server
from minisgl.server.listen import bind, quiet_client_faults, start_sites

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0  # after an engine failure, answer 503 this long before exiting


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
        runtime = Runtime(args)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    logger.info("model %s loaded in %.1f s; running with:\n%s", runtime.model_path,
                time.perf_counter() - started, runtime.config_block())
    await runtime.start()
    server = Server(runtime)
    try:
        runner, port = await listen(server, sockets)
    except ValueError:
        await runtime.stop()
        raise
    interrupted, terminated = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted.set)
    loop.add_signal_handler(signal.SIGTERM, terminated.set)
    print(f"minisgl ready: listening on {_url(args.host, port)}", flush=True)
    failed = asyncio.ensure_future(runtime.wait_failed())
    signalled = [asyncio.ensure_future(e.wait()) for e in (interrupted, terminated)]
    await asyncio.wait({failed, *signalled}, return_when=asyncio.FIRST_COMPLETED)
    if failed.done():
        logger.error("exiting: the server cannot serve any more (the cause is logged above)")
        server.shutting_down = True  # /health answers 503 while probes notice
        await asyncio.wait(signalled, timeout=FAILURE_GRACE_S)
    elif terminated.is_set() and not interrupted.is_set():
        # a second SIGTERM, SIGINT or a failure ends the drain early
        loop.add_signal_handler(signal.SIGTERM, interrupted.set)
        failed.add_done_callback(lambda _: interrupted.set())
        await server.drain(args.shutdown_timeout, interrupted)
    for wait in (failed, *signalled):
        wait.cancel()
    logger.info("shutting down")
    await server.shutdown(runner)  # runtime.stop: TP workers stopped, shared memory unlinked
    logger.info("stopped")
    if runtime.failed is not None:
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

"""HTTP plumbing shared by the endpoints: errors as `{"error": {"message", "type", "code"}}`,
JSON responses, reading a JSON body (its fields are parsed in minisgl.protocol), and
server-sent events: following several requests at once, and the one streaming response shape
every endpoint uses (`data: <json>` events, then `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import orjson
from aiohttp import web
from sse_starlette import ServerSentEvent

from minisgl.runtime import ReqHandle, RequestManager

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 415: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None,
                 code: int | str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.type = type or ERROR_TYPES.get(status, "error")
        self.code = status if code is None else code


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)


def error_response(status: int, message: str, type: str | None = None,
                   code: int | str | None = None, headers: dict[str, str] | None = None
                   ) -> web.Response:
    body = {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "error"),
                      "code": status if code is None else code}}
    return json_response(body, status, headers)


MAX_BODY = web.AppKey("max_body", int)  # --max-request-bytes
STREAM_WRITE_TIMEOUT = web.AppKey("stream_write_timeout", float)  # --stream-write-timeout
# Below this many bytes queued in the transport (far below its high-water mark) a write
# cannot wait for the client, so it needs no timer.
UNBLOCKED_WRITE_BYTES = 16 * 1024


def too_large(request: web.Request) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {request.app[MAX_BODY]} bytes")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object: 415 unless sent as application/json (a browser sends other
    types cross-site without asking first), 413 when too large, 400 when not an object."""
    if request.content_type != "application/json":
        raise HTTPError(415, "the request body must be JSON, sent with Content-Type: "
                        f"application/json (got {request.content_type!r})")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(request) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    return body


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(obj: Any) -> bytes:
    """`data: <json>\\n\\n`, as ServerSentEvent writes it: orjson never writes a raw CR or LF, so
    it is one data line, built here without the event's line split (once a token a stream)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = ServerSentEvent(data="[DONE]", sep="\n").encode()


def encode_typed_event(obj: dict[str, Any]) -> bytes:
    """`event: <its type>` then its data line, as OpenAI streams the Responses API."""
    return ServerSentEvent(data=orjson.dumps(obj).decode(), event=obj["type"],
                           sep="\n").encode()


async def follow(manager: RequestManager, handles: list[ReqHandle]
                 ) -> AsyncIterator[tuple[int, ReqHandle]]:
    """Yields (index, handle) whenever a handle's state changed, until all finished; each
    handle's last yield is the one where it is finished. Leaving early (the client went away,
    the handler was cancelled) aborts every request still running."""
    if len(handles) == 1:  # the common case: no pump task, no queue
        async with aclosing(manager.updates(handles[0])) as updates:
            async for handle in updates:
                yield 0, handle
        return
    changed: asyncio.Queue[int] = asyncio.Queue()

    async def pump(i: int, handle: ReqHandle) -> None:
        async with aclosing(manager.updates(handle)) as updates:
            async for _ in updates:
                changed.put_nowait(i)

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    done: set[int] = set()
    try:
        while len(done) < len(handles):
            i = await changed.get()
            if i in done:
                continue  # its final state was already yielded
            if handles[i].finished:
                done.add(i)
            yield i, handles[i]
    finally:
        for task in tasks:
            task.cancel()  # NOTE: cancelling a pump closes `updates`, which aborts the request
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_all(manager: RequestManager, handles: list[ReqHandle]) -> None:
    """Wait until every handle finished; cancellation aborts the unfinished ones."""
    await asyncio.gather(*(manager.wait(h) for h in handles))


class SlowReader(Exception):
    """A stream's client read nothing for --stream-write-timeout seconds."""


async def stream_response(request: web.Request, manager: RequestManager,
                          handles: list[ReqHandle],
                          chunk: Callable[[int, ReqHandle], Any | None],
                          first: list[Any] = (), last: Callable[[], list[Any]] | None = None,
                          typed: bool = False) -> web.StreamResponse:
    """Stream the handles' progress: the `first` events, then `chunk(i, handle)` each time
    handle i changed (None: nothing new to send; a list: several events), then the `last()`
    events and [DONE], or with `typed`, each event named by its type and no [DONE] (the
    Responses API). A client that goes away, before or during the stream, aborts the requests
    still running."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    response.content_type = "text/event-stream"
    response.charset = "utf-8"
    timeout = request.app[STREAM_WRITE_TIMEOUT]
    ended_by = "the client disconnected"

    async def write(data: bytes) -> None:
        """A client that stops reading fills the socket's buffers, then the transport's up to
        its high-water mark, where a write waits: for `timeout` seconds at most. Meanwhile
        the request's later tokens coalesce into the next event."""
        transport = request.transport
        if transport is not None and (transport.get_write_buffer_size() + len(data)
                                      < UNBLOCKED_WRITE_BYTES):
            await response.write(data)
            return
        try:
            await asyncio.wait_for(response.write(data), timeout)
        except asyncio.TimeoutError:
            raise SlowReader from None

    try:
        encode = encode_typed_event if typed else encode_event
        await response.prepare(request)
        for event in first:
            await write(encode(event))
        async with aclosing(follow(manager, handles)) as updates:
            async for i, handle in updates:
                news = chunk(i, handle)
                for event in news if isinstance(news, list) else [news]:
                    if event is not None:
                        await write(encode(event))
        for event in (last() if last is not None else []):
            await write(encode(event))
        if not typed:
            await write(DONE)
    except ConnectionResetError:
        pass  # the client went away
    except SlowReader:
        ended_by = "the client stopped reading the stream"
        logger.warning("a stream's client read nothing for %g s (--stream-write-timeout): "
                       "its requests are aborted", timeout)
        if request.transport is not None:
            request.transport.abort()  # NOTE: its buffered events are dropped, not waited on
    finally:
        for handle in handles:  # NOTE: all finished unless the client went away
            if not handle.finished:
                manager.abort(handle.rid, ended_by)
    return response

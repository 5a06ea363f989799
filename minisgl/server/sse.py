"""Server-sent events on an aiohttp StreamResponse, and following several requests at once."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator

import orjson
from aiohttp import web
from sse_starlette import ServerSentEvent

from minisgl.server.manager import ReqHandle, RequestManager

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(obj: Any) -> bytes:
    """`data: <json>\\n\\n` (orjson never writes a raw newline, so it is one data line)."""
    return ServerSentEvent(data=orjson.dumps(obj).decode(), sep="\n").encode()


DONE = ServerSentEvent(data="[DONE]", sep="\n").encode()


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    response.content_type = "text/event-stream"
    response.charset = "utf-8"
    await response.prepare(request)
    return response


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

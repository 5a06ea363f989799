"""The live page at /dashboard: static HTML and JavaScript shipped in the package (no build
step, no external assets), polling /dashboard/data once a second for the samples of the
server's `Timeline` it has not seen yet."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, AsyncIterator

from aiohttp import web

from minisgl.runtime import Runtime
from minisgl.server.http import json_response
from minisgl.server.timeline import Timeline
from minisgl.version import __version__

STATIC = Path(__file__).parent / "static"
PAGES = {"/dashboard": ("dashboard.html", "text/html"),
         "/dashboard.js": ("dashboard.js", "text/javascript")}
# NOTE: the page and its script hold no data: a browser can load them without the API key,
# then the script asks for the key when /dashboard/data answers 401.
OPEN_PATHS = frozenset(PAGES)


class Dashboard:
    def __init__(self, runtime: Runtime, timeline: Timeline) -> None:
        self.runtime, self.timeline = runtime, timeline
        self.files = {path: ((STATIC / name).read_bytes(), kind)
                      for path, (name, kind) in PAGES.items()}

    def routes(self) -> list[web.RouteDef]:
        return [*(web.get(path, self.page) for path in PAGES),
                web.get("/dashboard/data", self.data)]

    async def page(self, request: web.Request) -> web.Response:
        body, kind = self.files[request.path]
        return web.Response(body=body, content_type=kind, charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def data(self, request: web.Request) -> web.Response:
        """Samples after `since` (a sample's `t`); the server's settings and device on the
        first call."""
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            since = 0.0
        body: dict[str, Any] = {"samples": self.timeline.since(since)}
        if since <= 0:
            info = self.runtime.server_info()
            info.pop("internal_states")
            info.pop("resolved")  # NOTE: the same values, nested
            # NOTE: `device` is the one the engine runs on; the args say "auto" by default
            body["server"] = {"model": self.runtime.model_name, "version": __version__,
                              "device": self.runtime.engine.device.type,
                              "speculation": self.runtime.engine.speculation is not None,
                              "hierarchical_cache": self.runtime.engine.page_store is not None,
                              "args": info}
        return json_response(body)

    @contextlib.asynccontextmanager
    async def sampling(self) -> AsyncIterator[None]:
        """The timeline's once-a-second sampler, for as long as the server runs."""
        task = asyncio.create_task(self.timeline.run(), name="minisgl-timeline")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""HTTP plumbing shared by the endpoints: errors as `{"error": {"message", "type", "code"}}`,
JSON responses, and reading a JSON body (its fields are parsed in minisgl.protocol)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 415: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type or ERROR_TYPES.get(status, "error")
        self.code = status if code is None else code


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, type: str | None = None,
                   code: int | str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "error"),
                      "code": status if code is None else code}}
    return json_response(body, status)


MAX_BODY = web.AppKey("max_body", int)  # --max-request-bytes


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

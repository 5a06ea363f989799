"""Who may call the server: the API keys, the folders adapters may be loaded from, and the
browser rules that keep web pages out.

A server on localhost without a key is still reachable by any page the operator opens: a page
can post to it cross-site (simple requests need no preflight) or rebind its own DNS name to
127.0.0.1. So the `Host` header must name this server, cross-site requests are refused unless
their origin is listed in `--cors-origins`, and JSON bodies must say `application/json`
(`http.read_json`), which no cross-site form or `fetch` without a preflight can send.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from minisgl.server.http import HTTPError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
CROSS_SITE = frozenset({"cross-site", "same-site"})  # Sec-Fetch-Site values from other sites
PREFLIGHT_MAX_AGE_S = 600


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str | None:
    """The host of a Host header (`name:port`, `[v6]:port`), lower case; None if malformed."""
    try:
        return urlsplit(f"//{header}").hostname
    except ValueError:
        return None


class AdapterFolders:
    """The folders /load_lora_adapter may read: --lora-dirs and the folders holding
    --lora-paths' adapters. A path is resolved (links followed) before it is compared, so
    neither `..` nor a link leads out of them."""

    def __init__(self, folders: list[str]) -> None:
        self.folders = [Path(f).resolve() for f in folders]

    def check(self, path: str) -> None:
        try:
            resolved = Path(path).resolve()
        except (OSError, ValueError) as exc:
            raise HTTPError(400, f"lora_path is not a usable path: {exc}") from None
        if not any(resolved.is_relative_to(folder) for folder in self.folders):
            raise HTTPError(403, f"adapter path {path!r} refused: adapters load only from the "
                            "folders given at start (--lora-dirs, or the folders of "
                            "--lora-paths)" + ("" if self.folders else "; none were given"))


class Guard:
    def __init__(self, bound_host: str, api_key: str | None, allowed_hosts: list[str] | None,
                 cors_origins: list[str] | None, open_paths: frozenset[str] = frozenset(),
                 admin_api_key: str | None = None) -> None:
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.open_paths = OPEN_PATHS | open_paths
        self.any_host = (allowed_hosts is None and not is_loopback(bound_host)) or (
            allowed_hosts is not None and "*" in allowed_hosts)
        self.hosts = {h.lower() for h in (allowed_hosts or [])} | LOOPBACK_NAMES | {
            bound_host.strip("[]").lower()}
        self.origins = {o.rstrip("/").lower() for o in (cors_origins or [])}
        self.any_origin = "*" in self.origins

    def host_allowed(self, header: str | None) -> bool:
        if header is None or self.any_host:  # HTTP/1.0 clients may send none
            return True
        name = host_name(header)
        return name is not None and (name in self.hosts or is_loopback(name))

    def cors_origin(self, origin: str) -> bool:
        return self.any_origin or origin.rstrip("/").lower() in self.origins

    def _same_origin(self, request: web.Request, origin: str) -> bool:
        return urlsplit(origin).netloc.lower() == request.headers.get("Host", "").lower()

    def _check_site(self, request: web.Request) -> None:
        """A browser request from another site needs its origin in --cors-origins."""
        origin = request.headers.get("Origin")
        if origin is not None:
            if self._same_origin(request, origin) or self.cors_origin(origin):
                return
        elif request.headers.get("Sec-Fetch-Site") not in CROSS_SITE or self.any_origin:
            return
        raise HTTPError(403, f"cross-origin request from {origin or 'another site'} refused; "
                        "start the server with --cors-origins to allow a web page")

    @staticmethod
    def _presents(request: web.Request, key: str | None) -> bool:
        """Whether the request's bearer token is `key` (None: no key to present)."""
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # NOTE: the scheme is case-insensitive (RFC 7235); the key is compared in constant time
        return key is not None and scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode())

    def _check_key(self, request: web.Request) -> None:
        if not self.api_key or request.path in self.open_paths:
            return
        if not (self._presents(request, self.api_key)
                or self._presents(request, self.admin_api_key)):
            raise HTTPError(401, "a valid API key is needed: Authorization: Bearer KEY")

    def check_admin(self, request: web.Request, what: str) -> None:
        """An operation that changes the server (`what`): with --admin-api-key, that key only
        (--api-key, when set, was checked by the middleware)."""
        if self.admin_api_key is None or self._presents(request, self.admin_api_key):
            return
        if self.api_key is not None and self._presents(request, self.api_key):
            raise HTTPError(403, f"{what} needs the admin API key (--admin-api-key), not the "
                            "API key")
        raise HTTPError(401, f"{what} needs the admin API key: Authorization: Bearer KEY")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.host_allowed(request.headers.get("Host")):
            raise HTTPError(400, f"the Host header {request.headers.get('Host')!r} does not name "
                            "this server (DNS rebinding?); list it in --allowed-hosts")
        self._check_site(request)
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            return self._preflight(request)
        self._check_key(request)
        return await handler(request)

    def _preflight(self, request: web.Request) -> web.Response:
        """A CORS preflight from a listed origin (checked by _check_site) or the same one."""
        asked = request.headers.get("Access-Control-Request-Headers", "authorization, "
                                    "content-type")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": asked,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})

    async def add_cors_headers(self, request: web.Request,
                               response: web.StreamResponse) -> None:
        """on_response_prepare: let a listed origin's page read the answer (streams too)."""
        origin = request.headers.get("Origin")
        if origin is not None and self.origins and self.cors_origin(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if self.any_origin else origin
            response.headers["Vary"] = "Origin"

"""The listening side: the port is bound before the model loads, and what clients get wrong at
the HTTP level (malformed requests, TLS sent to the plain port, vanished connections) is logged
at debug level without a traceback, so that no client can flood the log."""

from __future__ import annotations

import asyncio
import logging
import socket

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

# NOTE: aiohttp logs these faults of a client's at ERROR with a traceback.
CLIENT_FAULTS = (HttpProcessingError, ConnectionError, asyncio.CancelledError, TimeoutError)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound (not yet listening: connections are refused until the server is ready)
    on every address of `host`; port 0 takes a free port, the same one for every address.
    Raises ValueError with one line when the address cannot be used."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
                (i[0], i[1], i[2], None, i[4][:2]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                address = (address[0], sockets[0].getsockname()[1])
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sockets


async def start_sites(runner: web.AppRunner, sockets: list[socket.socket]) -> int:
    """Listen on the bound sockets; returns the port."""
    for sock in sockets:
        await web.SockSite(runner, sock).start()
    return sockets[0].getsockname()[1]


class ClientFaultFilter(logging.Filter):
    """Turns aiohttp's ERROR records about a client's fault into one debug line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or not isinstance(exc, CLIENT_FAULTS):
            return True
        record.msg = f"{record.getMessage()}: {type(exc).__name__}: {exc}"
        record.args, record.exc_info, record.exc_text = None, None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_client_faults() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientFaultFilter) for f in logger.filters):
        logger.addFilter(ClientFaultFilter())

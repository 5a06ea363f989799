"""Embedding endpoints (--is-embedding): OpenAI's /v1/embeddings and SGLang's /encode, and the
guard that keeps each kind of server to its own endpoints. Bodies are parsed and answers
shaped in protocol.embeddings."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from minisgl.protocol.embeddings import (EMBEDDING_ONLY, GENERATION_ONLY, EmbeddingAborted,
                                         EmbeddingRequest, EmbeddingShape, embed, encode_results,
                                         openai_embeddings_body, parse_encode,
                                         parse_openai_embeddings)
from minisgl.protocol.fields import UnknownFields
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.runtime import ReqHandle, Runtime
from minisgl.server.guard import Handler
from minisgl.server.http import HTTPError, json_response, read_json

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions",
                              "/v1/responses"})


class EmbeddingsAPI:
    def __init__(self, runtime: Runtime, model: OpenAIModel, unknown: UnknownFields,
                 ensure_ready: Callable[[], None]) -> None:
        self.manager, self.model, self.unknown = runtime.requests, model, unknown
        self.ensure_ready = ensure_ready
        self.serves_embeddings = runtime.args.is_embedding
        self.shape = EmbeddingShape.of(runtime)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/embeddings", self.embeddings), web.post("/encode", self.encode)]

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """An embedding server refuses the generation endpoints, naming the flag."""
        if request.path in GENERATION_PATHS:
            raise HTTPError(400, f"{request.path}: {GENERATION_ONLY}")
        return await handler(request)

    async def embeddings(self, request: web.Request) -> web.Response:
        self._ensure_embedding_server(request)
        req = parse_openai_embeddings(await read_json(request), self.model, self.shape,
                                      self.unknown)
        return json_response(openai_embeddings_body(req, await self._run(req)))

    async def encode(self, request: web.Request) -> web.Response:
        self._ensure_embedding_server(request)
        req = parse_encode(await read_json(request), self.shape, self.unknown)
        return json_response(encode_results(req, await self._run(req)))

    def _ensure_embedding_server(self, request: web.Request) -> None:
        if not self.serves_embeddings:
            raise HTTPError(400, f"{request.path}: {EMBEDDING_ONLY}")
        self.ensure_ready()

    async def _run(self, req: EmbeddingRequest) -> list[ReqHandle]:
        """The inputs' handles, each with its embedding; 503 if one was aborted."""
        try:
            return await embed(self.manager, req)
        except EmbeddingAborted as exc:
            raise HTTPError(503, str(exc)) from None

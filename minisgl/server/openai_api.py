"""OpenAI-compatible endpoints: /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions, and vLLM's /tokenize and /detokenize (also under /v1/). Bodies are parsed
and answers shaped in protocol.openai_* and protocol.tokenize."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from minisgl.protocol.fields import UnknownFields
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_requests import parse_chat, parse_completion
from minisgl.protocol.openai_results import ChatAnswer, CompletionAnswer
from minisgl.protocol.token_texts import TokenTexts
from minisgl.protocol.tokenize import detokenize, tokenize
from minisgl.runtime import Runtime
from minisgl.server.http import json_response, read_json, stream_response, wait_all


class OpenAIAPI:
    def __init__(self, runtime: Runtime, tokens: TokenTexts, unknown: UnknownFields,
                 ensure_ready: Callable[[], None]) -> None:
        self.manager, self.tokens, self.unknown = runtime.requests, tokens, unknown
        self.model = OpenAIModel.of(runtime)
        self.ensure_ready = ensure_ready

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.named_model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                *(web.post(f"{prefix}/{name}", handler) for prefix in ("", "/v1")
                  for name, handler in (("tokenize", self.tokenize),
                                        ("detokenize", self.detokenize)))]

    async def models(self, request: web.Request) -> web.Response:
        return json_response(self.model.listing())

    async def named_model(self, request: web.Request) -> web.Response:
        return json_response(self.model.named_card(request.match_info["model"]))

    async def tokenize(self, request: web.Request) -> web.Response:
        return json_response(await tokenize(await read_json(request), self.manager, self.model,
                                            self.unknown))

    async def detokenize(self, request: web.Request) -> web.Response:
        return json_response(detokenize(await read_json(request), self.manager.tokenizer,
                                        self.model, self.unknown))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        req = parse_completion(await read_json(request), self.model,
                               self.manager.max_sequences, self.unknown)
        handles = await self.manager.submit_prompts(req.prompts, req.stream)
        answer = CompletionAnswer(req, handles, self.tokens, self.manager.tokenizer)
        if req.stream:
            return await stream_response(request, self.manager, handles, answer.stream_chunk,
                                         answer.stream_first(), answer.stream_last)
        await wait_all(self.manager, handles)
        return json_response(answer.body())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        tokenizer = self.manager.tokenizer
        req = parse_chat(await read_json(request), self.model,
                         tokenizer is not None and tokenizer.takes_tools,
                         self.manager.max_sequences, self.unknown)
        handles = await self.manager.submit_prompts(req.prompts, req.stream)
        answer = ChatAnswer(req, handles, self.model, self.tokens)
        if req.stream:
            return await stream_response(request, self.manager, handles, answer.stream_chunk,
                                         answer.stream_first(), answer.stream_last)
        await wait_all(self.manager, handles)
        return json_response(answer.body())

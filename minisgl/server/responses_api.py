"""OpenAI's Responses API: POST /v1/responses, and the stored responses' GET, DELETE,
/input_items (and /cancel, which has nothing to cancel: no response runs in the background).
Bodies are parsed in protocol.responses, answers shaped in protocol.responses_results."""

from __future__ import annotations

from typing import Callable

from aiohttp import web

from minisgl.protocol.fields import UnknownFields
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_results import ChatAnswer
from minisgl.protocol.responses import parse_responses
from minisgl.protocol.responses_results import ResponseAnswer
from minisgl.protocol.responses_store import ResponseStore, UnknownResponse
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import Runtime
from minisgl.server.http import HTTPError, json_response, read_json, stream_response, wait_all


class ResponsesAPI:
    def __init__(self, runtime: Runtime, model: OpenAIModel, tokens: TokenTexts,
                 unknown: UnknownFields, ensure_ready: Callable[[], None]) -> None:
        self.manager, self.model, self.tokens, self.unknown = (runtime.requests, model,
                                                               tokens, unknown)
        self.store = ResponseStore(runtime.args.max_stored_responses)
        self.ensure_ready = ensure_ready

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create),
                web.get("/v1/responses/{id}", self.retrieve),
                web.delete("/v1/responses/{id}", self.delete),
                web.get("/v1/responses/{id}/input_items", self.input_items),
                web.post("/v1/responses/{id}/cancel", self.cancel)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        tokenizer = self.manager.tokenizer
        try:
            req = parse_responses(await read_json(request), self.model, self.store,
                                  tokenizer is not None and tokenizer.takes_tools,
                                  self.manager.max_sequences, self.unknown)
        except UnknownResponse as exc:
            raise HTTPError(404, str(exc), "invalid_request_error",
                            "previous_response_not_found") from None
        handles = await self.manager.submit_prompts(req.chat.prompts, req.stream)
        answer = ResponseAnswer(req, handles[0], ChatAnswer(req.chat, handles, self.model,
                                                            self.tokens), tokenizer)

        def last() -> list[dict]:
            events = answer.stream_last()
            self._keep(answer, events[-1]["response"])
            return events

        if req.stream:
            return await stream_response(request, self.manager, handles, answer.stream_events,
                                         answer.stream_first(), last, typed=True)
        await wait_all(self.manager, handles)
        body = answer.body()
        self._keep(answer, body)
        return json_response(body)

    def _keep(self, answer: ResponseAnswer, response: dict) -> None:
        if answer.req.store:
            self.store.put(answer.stored(response))

    def _stored(self, request: web.Request):
        try:
            return self.store.get(request.match_info["id"])
        except UnknownResponse as exc:
            raise HTTPError(404, str(exc)) from None

    async def retrieve(self, request: web.Request) -> web.Response:
        return json_response(self._stored(request).response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = self._stored(request).response["id"]
        self.store.delete(response_id)
        return json_response({"id": response_id, "object": "response.deleted",
                              "deleted": True})

    async def input_items(self, request: web.Request) -> web.Response:
        items = self._stored(request).input_items
        return json_response({"object": "list", "data": items,
                              "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None,
                              "has_more": False})

    async def cancel(self, request: web.Request) -> web.Response:
        self._stored(request)
        raise HTTPError(400, "Cannot cancel a synchronous response: only background responses "
                        "can be cancelled, and minisgl runs none.")

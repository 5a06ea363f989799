"""OpenAI-compatible endpoints: /v1/models (and /v1/models/{id}), /v1/completions,
/v1/chat/completions. Which fields are read, ignored or refused: openai_fields."""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any, Callable

from aiohttp import web

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.runtime import ReqHandle, Runtime
from minisgl.runtime.manager import Prompt
from minisgl.runtime.native import check_bool, check_int, check_priority, is_ids, none_as
from minisgl.runtime.token_texts import TokenTexts
from minisgl.scheduler import expand_samples
from minisgl.server.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_TOP_LOGPROBS,
                                          StreamOptions, chat_template_kwargs, check_fields,
                                          flag, normalize_messages, sampling_params,
                                          split_prefill, stream_options)
from minisgl.server.openai_logprobs import Cursor, chat_logprobs, completion_logprobs
from minisgl.server.openai_tool_parser import ToolCallParser
from minisgl.server.openai_tools import ToolUse, parse_tool_use, render_tools
from minisgl.server.protocol import HTTPError, json_response, read_json
from minisgl.server.sse import stream_response, wait_all


# NOTE: sglang-router fills a chat request's missing `model` with this name
ROUTER_PLACEHOLDER_MODEL = "unknown"


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason.get("type")


def matched_stop(reason: dict[str, Any] | None) -> Any:
    return reason.get("matched") if reason and reason.get("type") == "stop" else None


def usage(groups: list[list[Prompt]], handles: list[ReqHandle]) -> dict[str, int]:
    """A prompt sampled n times counts its tokens once, as OpenAI does."""
    prompt = sum(len(g[0].input_ids or []) for g in groups)
    completion = sum(len(h.output_ids) for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def choice_usage(h: ReqHandle) -> dict[str, int]:
    """One choice's usage so far (stream_options.continuous_usage_stats)."""
    prompt, completion = len(h.prompt_ids), len(h.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class OpenAIAPI:
    def __init__(self, runtime: Runtime, tokens: TokenTexts,
                 ensure_ready: Callable[[], None]) -> None:
        self.runtime, self.manager = runtime, runtime.requests
        self.model_name, self.ensure_ready = runtime.model_name, ensure_ready
        self.tokens = tokens
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.models),
                web.get("/v1/models/{model:.+}", self.model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions)]

    def _card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "minisgl",
                "root": name, "parent": None, "max_model_len": self.runtime.context_len}

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list",
                              "data": [self._card(name) for name in self.runtime.served_names]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in self.runtime.model_aliases:
            raise HTTPError(404, f"The model '{name}' does not exist", "invalid_request_error",
                            "model_not_found")
        return json_response(self._card(name))

    def _model(self, body: dict[str, Any]) -> str:
        """The name the answer reports: the requested one if it is a served name, else the
        first served name. Any `model` is served (one model per server, as SGLang does),
        unless --strict-model-name asks for a 404 on names that are not the model's."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string")
        if model == ROUTER_PLACEHOLDER_MODEL:
            model = None
        strict = self.runtime.args.strict_model_name
        if strict and model and model not in self.runtime.model_aliases:
            raise HTTPError(404, f"The model `{model}` does not exist (this server serves "
                            f"`{self.model_name}`).", "invalid_request_error", "model_not_found")
        return model if model in self.runtime.served_names else self.model_name

    def _rid(self, body: dict[str, Any], prefix: str) -> str:
        rid = body.get("rid")
        if rid is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest("rid must be a non-empty string")
        return rid

    # ---- /v1/completions ---------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        body = await read_json(request)
        check_fields(body, "/v1/completions", COMPLETION_FIELDS, self.runtime.unknown_fields)
        model = self._model(body)
        raw = body.get("prompt")
        if isinstance(raw, str):
            prompts = [Prompt([], SamplingParams(), text=raw)]
        elif isinstance(raw, list) and raw and all(isinstance(p, str) for p in raw):
            prompts = [Prompt([], SamplingParams(), text=p) for p in raw]
        elif is_ids(raw) and raw:
            prompts = [Prompt(list(raw), SamplingParams())]
        elif isinstance(raw, list) and raw and all(is_ids(p) for p in raw):
            prompts = [Prompt(list(p), SamplingParams()) for p in raw]
        else:
            raise InvalidRequest("prompt must be a string, a list of strings, a list of token "
                                 "ids or a list of such lists (non-empty)")
        max_tokens = body.get("max_tokens")
        params = sampling_params(body, 16 if max_tokens is None else max_tokens)
        logprobs = body.get("logprobs")
        if logprobs is not None:
            check_int(logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
        echo = flag(body, "echo")
        echo_logprobs = echo and logprobs is not None  # the prompt's logprobs come first
        stream, options = flag(body, "stream"), stream_options(body)
        priority = check_priority(body.get("priority"))
        for p in prompts:
            p.params, p.logprob_num = params, (-1 if logprobs is None else logprobs)
            p.logprob_start_len, p.priority = (0 if echo_logprobs else -1), priority
        rid = self._rid(body, "cmpl")
        groups = expand_samples(prompts, self.manager.max_sequences)
        flat = [p for g in groups for p in g]
        for k, p in enumerate(flat):
            p.rid = f"{rid}-{k}"
        handles = await self.manager.submit_prompts(flat, stream)
        echoes = [""] * len(flat)
        if echo:
            tokenizer = self.manager.tokenizer
            # NOTE: special tokens kept, so the text agrees with the echoed logprob tokens
            echoes = [p.text if p.text is not None else
                      (tokenizer.decode(p.input_ids, skip_special_tokens=False) if tokenizer
                       else "") for p in flat]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": model}
        if stream:
            return await self._stream(request, head, groups, handles, options,
                                      self._completion_choice, echoes, echo_logprobs)
        await wait_all(self.manager, handles)
        choices = [self._completion_choice(k, h, Cursor(prefix=echoes[k],
                                                        prompt_logprobs=echo_logprobs))
                   for k, h in enumerate(handles)]
        return json_response({**head, "choices": choices, "usage": usage(groups, handles)})

    def _completion_choice(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        """What the client has not been sent yet of choice k; advances the cursor."""
        text = h.text
        choice: dict[str, Any] = {"index": k, "text": cursor.prefix + text[cursor.chars:],
                                  "logprobs": None,
                                  "finish_reason": finish_reason(h.finish_reason) if h.finished
                                  else None}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        if h.logprob_num >= 0:
            choice["logprobs"] = completion_logprobs(self.tokens, h, cursor)
        cursor.chars, cursor.prefix = len(text), ""
        return choice

    # ---- /v1/chat/completions ----------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        body = await read_json(request)
        check_fields(body, "/v1/chat/completions", CHAT_FIELDS, self.runtime.unknown_fields)
        model = self._model(body)
        continue_final = flag(body, "continue_final_message")
        generation_prompt = check_bool(none_as(body.get("add_generation_prompt"), True),
                                       "add_generation_prompt")
        if continue_final and generation_prompt and body.get("add_generation_prompt"):
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                                 "be true: set add_generation_prompt to false to continue the "
                                 "final message")
        messages, prefix = split_prefill(normalize_messages(body.get("messages")), continue_final)
        template_kwargs = {**chat_template_kwargs(body),
                           "add_generation_prompt": generation_prompt}
        tools = parse_tool_use(body)
        if tools is not None:
            messages, extra = render_tools(messages, tools, self.manager.tokenizer is not None
                                           and self.manager.tokenizer.takes_tools)
            template_kwargs = {**template_kwargs, **extra}
        logprobs = flag(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            check_int(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not logprobs:
                raise InvalidRequest("top_logprobs needs logprobs set to true")
        stream, options = flag(body, "stream"), stream_options(body)
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        # NOTE: None is OpenAI's default: whatever room the context leaves
        params = sampling_params(body, max_tokens, self.runtime.sampling_defaults)
        if tools is not None and tools.grammar() is not None:
            if params.grammar is not None:
                raise InvalidRequest("tool_choice required or a named function constrains the "
                                     "answer already: drop response_format / regex / ebnf")
            params.json_schema = tools.grammar()
        ids = await self.manager.encode_chat(messages, template_kwargs, prefix)
        rid = self._rid(body, "chatcmpl")
        groups = expand_samples([Prompt(ids, params, logprob_num=(top or 0) if logprobs else -1,
                                        priority=check_priority(body.get("priority")))],
                                self.manager.max_sequences)
        flat = groups[0]
        for k, p in enumerate(flat):
            p.rid = f"{rid}-{k}"
        handles = await self.manager.submit_prompts(flat, stream)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": model}
        if stream:
            head["object"] = "chat.completion.chunk"
            delta = (self._chat_delta if tools is None
                     else partial(self._tool_delta, tools, {}))  # a parser per choice
            return await self._stream(request, head, groups, handles, options, delta, None)
        await wait_all(self.manager, handles)
        choices = []
        for k, h in enumerate(handles):
            message, reason = self._message(h, tools)
            choices.append({
                "index": k, "message": message,
                "logprobs": (chat_logprobs(self.tokens, h, Cursor()) if h.logprob_num >= 0
                             else None),
                "finish_reason": reason, "matched_stop": matched_stop(h.finish_reason)})
        return json_response({**head, "choices": choices, "usage": usage(groups, handles)})

    def _message(self, h: ReqHandle, tools: ToolUse | None
                 ) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish_reason ("tool_calls" when it called and
        stopped by itself), read by the same parser a stream uses."""
        if tools is None:
            return {"role": "assistant", "content": h.text}, finish_reason(h.finish_reason)
        parser = tools.parser(self.runtime.args.tool_call_parser)
        content, calls = parser.parse(h.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, parser.finish_reason(finish_reason(h.finish_reason))

    def _tool_delta(self, tools: ToolUse, parsers: dict[int, ToolCallParser], k: int,
                    h: ReqHandle, cursor: Cursor) -> dict[str, Any] | None:
        """What choice k's text adds, as OpenAI streams calls: content as it comes; for call
        i a delta.tool_calls entry with its index, id, type and name, then its arguments in
        pieces (openai_tool_parser)."""
        if k not in parsers:
            parsers[k] = tools.parser(self.runtime.args.tool_call_parser)
        parser = parsers[k]
        new = parser.feed(h.text)
        if h.finished:
            new += parser.finish()
        cursor.chars = len(h.text)
        delta: dict[str, Any] = {}
        if new.content:
            delta["content"] = new.content
        if new.tool_calls:
            delta["tool_calls"] = new.tool_calls
        logprobs = chat_logprobs(self.tokens, h, cursor) if h.logprob_num >= 0 else None
        if not delta and not h.finished and not (logprobs and logprobs["content"]):
            return None  # held back (what may be a call's start), no new token either
        choice: dict[str, Any] = {
            "index": k, "delta": delta, "logprobs": logprobs,
            "finish_reason": (parser.finish_reason(finish_reason(h.finish_reason))
                              if h.finished else None)}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        return choice

    def _chat_delta(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        text = h.text
        delta = {"content": text[cursor.chars:]} if len(text) > cursor.chars else {}
        choice: dict[str, Any] = {
            "index": k, "delta": delta,
            "logprobs": chat_logprobs(self.tokens, h, cursor) if h.logprob_num >= 0 else None,
            "finish_reason": finish_reason(h.finish_reason) if h.finished else None}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        cursor.chars = len(text)
        return choice

    # ---- streaming, shared -------------------------------------------------------------------

    async def _stream(self, request: web.Request, head: dict[str, Any],
                      groups: list[list[Prompt]], handles: list[ReqHandle],
                      options: StreamOptions,
                      make_choice: Callable[[int, ReqHandle, Cursor], dict[str, Any] | None],
                      prefixes: list[str] | None, prompt_logprobs: bool = False
                      ) -> web.StreamResponse:
        """One chunk per change of one choice: the text it gained (a delta, as OpenAI streams),
        with its finish_reason once it ended; a usage chunk if asked; then [DONE]."""
        no_usage = {"usage": None} if options.include_usage or options.continuous_usage else {}
        cursors = [Cursor(prefix=p, prompt_logprobs=prompt_logprobs)
                   for p in (prefixes or [""] * len(handles))]
        first = []
        if head["object"] == "chat.completion.chunk":  # the role comes first, alone
            first = [{**head, "choices": [{"index": k, "delta": {"role": "assistant",
                                                                   "content": ""},
                                           "logprobs": None, "finish_reason": None}],
                      **no_usage} for k in range(len(handles))]

        def chunk(k: int, h: ReqHandle) -> dict[str, Any] | None:
            c = cursors[k]
            if (len(h.text) == c.chars and not c.prefix and not h.finished
                    and (h.logprob_num < 0 or len(h.token_logprobs) == c.tokens)):
                return None  # nothing to send (e.g. half a UTF-8 character so far)
            choice = make_choice(k, h, c)
            if choice is None:
                return None
            extra = {"usage": choice_usage(h)} if options.continuous_usage else no_usage
            return {**head, "choices": [choice], **extra}

        def usage_chunk() -> list[dict[str, Any]]:
            if not options.include_usage:
                return []
            return [{**head, "choices": [], "usage": usage(groups, handles)}]

        return await stream_response(request, self.manager, handles, chunk, first, usage_chunk)

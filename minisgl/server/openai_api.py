"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions.

Fields minisgl cannot honour (logit_bias, tools, suffix, ...) are refused with a 400 rather
than ignored; fields that change nothing about the output (user, metadata, ...) are ignored.
SGLang's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids,
ignore_eos, skip_special_tokens, no_stop_trim) are accepted too (the client's `extra_body`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.runtime import ReqHandle, Runtime
from minisgl.scheduler import expand_samples
from minisgl.server.protocol import (
    HTTPError,
    Prompt,
    check_bool,
    check_int,
    is_ids,
    json_response,
    none_as,
    read_json,
    submit_all,
)
from minisgl.server.sse import stream_response, wait_all
from minisgl.server.token_texts import TokenTexts

MAX_TOP_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

SAMPLING_FIELDS = {  # OpenAI (or SGLang extension) name -> SamplingParams name
    "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
    "seed": "sampling_seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logit_bias": "logit_bias",
}


@dataclass
class Cursor:
    """How much of one choice a client has been sent."""

    chars: int = 0  # of the text
    tokens: int = 0  # of the logprobs
    offset: int = 0  # text_offset of the next token (completions logprobs)
    prefix: str = ""  # echo text still to send
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's still to send


def finish_reason(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason.get("type")


def matched_stop(reason: dict[str, Any] | None) -> Any:
    return reason.get("matched") if reason and reason.get("type") == "stop" else None


def refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("suffix"):
        raise InvalidRequest("suffix is not supported by minisgl")
    if body.get("tools") or body.get("functions"):
        raise InvalidRequest("tools and functions are not supported by minisgl")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice is not supported by minisgl")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise InvalidRequest("only response_format {\"type\": \"text\"} is supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise InvalidRequest("best_of other than n is not supported by minisgl")


def sampling_params(body: dict[str, Any], max_new_tokens: Any) -> SamplingParams:
    values = {ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items() if theirs in body}
    values["max_new_tokens"] = max_new_tokens
    return SamplingParams.from_dict(values)


def stream_usage_wanted(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return check_bool(none_as(options.get("include_usage"), False), "stream_options.include_usage")


def flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field: true, false, or absent / null (false)."""
    return check_bool(none_as(body.get(name), False), name)


def usage(groups: list[list[Prompt]], handles: list[ReqHandle]) -> dict[str, int]:
    """A prompt sampled n times counts its tokens once, as OpenAI does."""
    prompt = sum(len(g[0].input_ids or []) for g in groups)
    completion = sum(len(h.output_ids) for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Text content parts joined into one string, which every chat template understands."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest("each message must be an object with a string role")
        if m["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"messages: unknown role {m['role']!r} (one of "
                                 f"{', '.join(sorted(CHAT_ROLES))})")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequest("only text content parts are supported")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest("message content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


class OpenAIAPI:
    def __init__(self, runtime: Runtime, model_name: str, model_aliases: set[str],
                 tokens: TokenTexts, ensure_ready: Callable[[], None]) -> None:
        self.runtime, self.manager = runtime, runtime.requests
        self.model_name, self.ensure_ready = model_name, ensure_ready
        self.model_names = {model_name, *model_aliases}  # what `model` may name
        self.tokens = tokens
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions)]

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "minisgl", "root": str(self.runtime.model_path),
            "max_model_len": self.runtime.context_len}]})

    def _model(self, body: dict[str, Any]) -> str:
        """The served model's name; 404 for a model this server does not serve (an empty or
        absent `model` means the served one)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("model must be a string")
        if model and model not in self.model_names:
            raise HTTPError(404, f"The model `{model}` does not exist (this server serves "
                            f"`{self.model_name}`).", "invalid_request_error", "model_not_found")
        return model or self.model_name

    # ---- /v1/completions ---------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        body = await read_json(request)
        refuse_unsupported(body)
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
        stream = flag(body, "stream")
        include_usage = stream_usage_wanted(body)
        for p in prompts:
            p.params, p.logprob_num = params, (-1 if logprobs is None else logprobs)
            p.logprob_start_len = 0 if echo_logprobs else -1
        rid = f"cmpl-{uuid.uuid4().hex}"
        groups = expand_samples(prompts, self.manager.max_sequences)
        flat = [p for g in groups for p in g]
        for k, p in enumerate(flat):
            p.rid = f"{rid}-{k}"
        handles = await submit_all(self.manager, flat)
        echoes = [""] * len(flat)
        if echo:
            tokenizer = self.manager.tokenizer
            echoes = [p.text if p.text is not None else
                      (tokenizer.decode(p.input_ids) if tokenizer else "") for p in flat]
        head = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": model}
        if stream:
            return await self._stream(request, head, groups, handles, include_usage,
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
            choice["logprobs"] = self._completion_logprobs(h, cursor)
        cursor.chars, cursor.prefix = len(text), ""
        return choice

    @staticmethod
    def _unsent_logprobs(h: ReqHandle, cursor: Cursor
                         ) -> tuple[list[tuple[float, int]], list[list[tuple[float, int]]]]:
        """The token and top logprobs not sent yet; advances the cursor past them."""
        new, tops = h.token_logprobs[cursor.tokens:], h.top_logprobs[cursor.tokens:]
        cursor.tokens += len(new)
        return new, tops

    def _completion_logprobs(self, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        new, tops = self._unsent_logprobs(h, cursor)
        values: list[float | None] = [lp for lp, _ in new]
        ids = [t for _, t in new]
        steps: list[list[tuple[float, int]] | None] = list(tops)
        if cursor.prompt_logprobs:  # echo: the prompt's tokens first, the first one unscored
            cursor.prompt_logprobs = False
            scored = len(h.input_logprobs)
            values = [None, *h.input_logprobs, *values]
            ids = [*h.prompt_ids[: scored + 1], *ids]
            steps = [None, *h.input_top_logprobs, *steps]
        texts = self.tokens.texts(ids)
        top_texts = self.tokens.texts([t for step in steps if step for _, t in step])
        offsets = []
        for text in texts:
            offsets.append(cursor.offset)
            cursor.offset += len(text)
        top_dicts: list[dict[str, float] | None] = []
        at = 0
        for step in steps:
            if step is None:
                top_dicts.append(None)
                continue
            top_dicts.append({top_texts[at + i]: lp for i, (lp, _) in enumerate(step)})
            at += len(step)
        return {"tokens": texts, "token_logprobs": values, "top_logprobs": top_dicts,
                "text_offset": offsets}

    # ---- /v1/chat/completions ----------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.ensure_ready()
        body = await read_json(request)
        refuse_unsupported(body)
        model = self._model(body)
        messages = normalize_messages(body.get("messages"))
        logprobs = flag(body, "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            check_int(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not logprobs:
                raise InvalidRequest("top_logprobs needs logprobs set to true")
        stream = flag(body, "stream")
        include_usage = stream_usage_wanted(body)
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        sampling_params(body, 1)  # validate before the (maybe slow) template and encode
        ids = await self.manager.encode_chat(messages)
        if max_tokens is None:  # OpenAI's default: whatever room the context leaves
            max_tokens = max(self.runtime.max_sequence_len - len(ids), 1)
        params = sampling_params(body, max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        groups = expand_samples([Prompt(ids, params, logprob_num=(top or 0) if logprobs else -1)],
                                self.manager.max_sequences)
        flat = groups[0]
        for k, p in enumerate(flat):
            p.rid = f"{rid}-{k}"
        handles = await submit_all(self.manager, flat)
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": model}
        if stream:
            head["object"] = "chat.completion.chunk"
            return await self._stream(request, head, groups, handles, include_usage,
                                      self._chat_delta, None)
        await wait_all(self.manager, handles)
        choices = []
        for k, h in enumerate(handles):
            choices.append({
                "index": k, "message": {"role": "assistant", "content": h.text},
                "logprobs": self._chat_logprobs(h, Cursor()) if h.logprob_num >= 0 else None,
                "finish_reason": finish_reason(h.finish_reason),
                "matched_stop": matched_stop(h.finish_reason)})
        return json_response({**head, "choices": choices, "usage": usage(groups, handles)})

    def _chat_logprobs(self, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        new, tops = self._unsent_logprobs(h, cursor)
        texts = self.tokens.text_and_bytes([t for _, t in new])
        top_texts = self.tokens.text_and_bytes([t for step in tops for _, t in step])
        content, at = [], 0
        for (lp, _), (text, raw), step in zip(new, texts, tops):
            alts = [{"token": top_texts[at + i][0], "logprob": alp,
                     "bytes": list(top_texts[at + i][1])} for i, (alp, _) in enumerate(step)]
            at += len(step)
            content.append({"token": text, "logprob": lp, "bytes": list(raw),
                            "top_logprobs": alts})
        return {"content": content}

    def _chat_delta(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        text = h.text
        delta = {"content": text[cursor.chars:]} if len(text) > cursor.chars else {}
        choice: dict[str, Any] = {
            "index": k, "delta": delta,
            "logprobs": self._chat_logprobs(h, cursor) if h.logprob_num >= 0 else None,
            "finish_reason": finish_reason(h.finish_reason) if h.finished else None}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        cursor.chars = len(text)
        return choice

    # ---- streaming, shared -------------------------------------------------------------------

    async def _stream(self, request: web.Request, head: dict[str, Any],
                      groups: list[list[Prompt]], handles: list[ReqHandle], include_usage: bool,
                      make_choice: Callable[[int, ReqHandle, Cursor], dict[str, Any]],
                      prefixes: list[str] | None, prompt_logprobs: bool = False
                      ) -> web.StreamResponse:
        """One chunk per change of one choice: the text it gained (a delta, as OpenAI streams),
        then a chunk with its finish_reason; a usage chunk if asked; then [DONE]."""
        extra = {"usage": None} if include_usage else {}
        cursors = [Cursor(prefix=p, prompt_logprobs=prompt_logprobs)
                   for p in (prefixes or [""] * len(handles))]
        first = []
        if head["object"] == "chat.completion.chunk":  # the role comes first, alone
            first = [{**head, "choices": [{"index": k, "delta": {"role": "assistant",
                                                                   "content": ""},
                                           "logprobs": None, "finish_reason": None}], **extra}
                     for k in range(len(handles))]

        def chunk(k: int, h: ReqHandle) -> dict[str, Any] | None:
            c = cursors[k]
            if (len(h.text) == c.chars and not c.prefix and not h.finished
                    and (h.logprob_num < 0 or len(h.token_logprobs) == c.tokens)):
                return None  # nothing to send (e.g. half a UTF-8 character so far)
            return {**head, "choices": [make_choice(k, h, c)], **extra}

        def usage_chunk() -> list[dict[str, Any]]:
            return [{**head, "choices": [], "usage": usage(groups, handles)}] if include_usage \
                else []

        return await stream_response(request, self.manager, handles, chunk, first, usage_chunk)

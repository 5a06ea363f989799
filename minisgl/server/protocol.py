"""Request parsing shared by the HTTP endpoints, and SGLang's native `/generate` protocol.

Everything here validates before anything is queued: a batch with one bad element fails as a
whole. Errors are raised as `HTTPError` (or the core's `InvalidRequest`, which means 400) and
rendered by the app as `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import orjson
from aiohttp import web

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.runtime import ReqHandle, RequestManager
from minisgl.scheduler import RequestSpec, expand_samples
from minisgl.server.token_texts import TokenTexts

MAX_TOP_LOGPROBS = 100  # native API; the OpenAI endpoints allow 20, as OpenAI does

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


# ---- small type checks -----------------------------------------------------------------------

def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(t) for t in value)


def none_as(value: Any, default: Any) -> Any:
    """JSON null means the field's default."""
    return default if value is None else value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{name} must be an integer {bound}, got {value!r}")
    return value


def per_item(value: Any, count: int, name: str, check: Callable[[Any], Any],
             single: bool) -> list[Any]:
    """A field that is one value for every prompt or (in a batch) a list with one per prompt."""
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} elements for {count} prompts")
        return [check(v) for v in value]
    return [check(value)] * count


# ---- submission ------------------------------------------------------------------------------

@dataclass
class Prompt(RequestSpec):
    """A request to submit; a text prompt gets its input_ids on submission."""

    text: str | None = None


async def submit_all(manager: RequestManager, prompts: list[Prompt]) -> list[ReqHandle]:
    """Tokenize the text prompts (one batched call), then queue the batch, all or nothing."""
    texts = [p for p in prompts if p.text is not None]
    for p in texts:
        if not p.text:
            raise InvalidRequest("the prompt is empty")
    if texts:
        unique = list(dict.fromkeys(p.text for p in texts))  # n > 1 repeats a text n times
        ids = dict(zip(unique, await manager.encode(unique)))
        for p in texts:
            p.input_ids = ids[p.text]
    return manager.submit(list(prompts))


# ---- SGLang-native /generate -----------------------------------------------------------------

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
                   "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs",
                   "log_metrics"}
# SGLang fields for features minisgl lacks: accepted only when they ask for nothing.
UNSUPPORTED_UNLESS_EMPTY = {"lora_path", "image_data", "video_data", "audio_data",
                            "return_hidden_states", "custom_logit_processor", "modalities"}


@dataclass
class GenerateRequest:
    groups: list[list[Prompt]]  # per prompt, its n samples
    single: bool  # answer one object (one prompt, n == 1) rather than a list
    stream: bool
    text_in_logprobs: bool

    @property
    def prompts(self) -> list[Prompt]:
        return [p for group in self.groups for p in group]


def parse_generate(body: dict[str, Any], max_sequences: int) -> GenerateRequest:
    unknown = sorted(set(body) - GENERATE_FIELDS - UNSUPPORTED_UNLESS_EMPTY)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    for name in UNSUPPORTED_UNLESS_EMPTY & set(body):
        if body[name]:
            raise InvalidRequest(f"{name} is not supported by minisgl")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            single, texts = True, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            single, texts = False, text
        else:
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        prompts = [Prompt([], SamplingParams(), text=t) for t in texts]
    else:
        if is_ids(input_ids) and input_ids:
            single, batches = True, [input_ids]
        elif isinstance(input_ids, list) and input_ids and all(is_ids(x) for x in input_ids):
            single, batches = False, input_ids
        else:
            raise InvalidRequest("input_ids must be a non-empty list of token ids or a "
                                 "non-empty list of such lists")
        prompts = [Prompt(list(ids), SamplingParams()) for ids in batches]
    count = len(prompts)

    params = per_item(body.get("sampling_params"), count, "sampling_params",
                      SamplingParams.from_dict, single)

    def check_rid(r: Any) -> str | None:
        if r is not None and (not isinstance(r, str) or not r):
            raise InvalidRequest(f"rid must be a non-empty string, got {r!r}")
        return r

    rid = body.get("rid")
    if not single and isinstance(rid, str):
        raise InvalidRequest("a batch needs rid as a list with one string per prompt")
    rids = per_item(rid, count, "rid", check_rid, single)
    want = per_item(body.get("return_logprob"), count, "return_logprob",
                    lambda v: check_bool(none_as(v, False), "return_logprob"), single)
    tops = per_item(none_as(body.get("top_logprobs_num"), 0), count, "top_logprobs_num",
                    lambda v: check_int(v, "top_logprobs_num", 0, MAX_TOP_LOGPROBS), single)
    starts = per_item(body.get("logprob_start_len"), count, "logprob_start_len",
                      lambda v: check_int(none_as(v, -1), "logprob_start_len", -1), single)
    for p, sp, r, w, k, start in zip(prompts, params, rids, want, tops, starts):
        p.params, p.rid, p.logprob_num = sp, r, (k if w else -1)
        p.logprob_start_len = start if w else -1
    stream = check_bool(none_as(body.get("stream"), False), "stream")
    text_in_logprobs = check_bool(none_as(body.get("return_text_in_logprobs"), False),
                                  "return_text_in_logprobs")
    check_bool(none_as(body.get("log_metrics"), True), "log_metrics")
    groups = expand_samples(prompts, max_sequences)
    return GenerateRequest(groups, single and len(groups[0]) == 1, stream, text_in_logprobs)


def generate_result(handle: ReqHandle, tokens: TokenTexts | None) -> dict[str, Any]:
    """ReqHandle.result(), with logprob entries' token text filled in if `tokens` is given."""
    result = handle.result()
    meta = result["meta_info"]
    if tokens is not None and "output_token_logprobs" in meta:
        entries = [*meta["output_token_logprobs"], *meta["input_token_logprobs"]]
        entries += [e for key in ("output_top_logprobs", "input_top_logprobs")
                    for step in meta[key] if step is not None for e in step]
        for entry, text in zip(entries, tokens.texts([e[1] for e in entries])):
            entry[2] = text
    return result

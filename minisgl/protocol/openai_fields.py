"""The OpenAI endpoints' request fields (OpenAI's, plus SGLang's extensions as of 0.5.23).

The same policy as `/generate` (protocol.fields): a field minisgl acts on is checked and used;
an inert one is accepted with any value; one for a feature minisgl lacks is accepted at its
default and refused with a 400 naming it otherwise; an unknown one is ignored and logged once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from minisgl.core import GRAMMAR_FIELDS, SamplingParams, asks_nothing
from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import UnknownFields, check_bool, none_as, refuse_unsupported
from minisgl.protocol.image_parts import IMAGE_PART_TYPES, image_source, join_parts

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
    "logit_bias": "logit_bias", "json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf",
    "stop_regex": "stop_regex", "structural_tag": "structural_tag",
}
# Other servers' ways to ask for a constrained answer (vLLM's structured_outputs and older
# guided_*, llama.cpp's grammar), honoured through the same grammar kinds: key -> grammar kind.
STRUCTURED_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf",
                           "choice": "choice", "json_object": "json_object",
                           "structural_tag": "structural_tag"}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
                 "guided_choice": "choice", "grammar": "grammar"}
# Options of vLLM's structured outputs that change nothing here (minisgl has one backend and
# never falls back to another).
INERT_STRUCTURED_OPTIONS = frozenset({"backend", "_backend", "disable_fallback",
                                      "guided_decoding_backend"})
# Read by the endpoints themselves.
COMMON_FIELDS = frozenset({"model", "stream", "stream_options", "max_tokens", "rid",
                           "return_cached_tokens_details",
                           "response_format", "best_of", "priority", "structured_outputs",
                           *GUIDED_FIELDS, "guided_decoding_backend",
                           "guided_whitespace_pattern", "lora_path"})
# How a chat answer's reasoning is returned (--reasoning-parser); a completion is never split.
REASONING_FIELDS = frozenset({"separate_reasoning", "stream_reasoning"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "logprobs"} | REASONING_FIELDS
CHAT_FIELDS = COMMON_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                               "tools", "tool_choice", "continue_final_message",
                               "add_generation_prompt", "chat_template_kwargs",
                               "parallel_tool_calls", "reasoning_effort"} | REASONING_FIELDS
# Nothing a client sees depends on these.
INERT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "custom_labels",
                          "custom_params"})
# Features minisgl lacks: accepted only at their default.
UNSUPPORTED_FIELDS = frozenset({
    "suffix", "functions", "function_call", "reasoning", "thinking",
    "task", "audio", "modalities",
    "prediction", "web_search_options", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_spec_tokens_details",
    "return_token_ids", "return_prompt_token_ids", "return_meta_info",
    "return_input_ids_in_sglext", "return_output_ids_in_sglext", "return_sampling_mask",
    "sampling_logprobs_mode", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "session_id", "session_params",
    "custom_logit_processor", "watermark", "images_config", "video_config",
    "mm_processor_kwargs", "max_dynamic_patch", "min_dynamic_patch", "use_audio_in_video",
    "data_parallel_rank", "routed_dp_rank", "disagg_prefill_dp_rank", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "extra_key", "cache_salt", "input_ids"})


def check_fields(body: dict[str, Any], endpoint: str, own: frozenset[str] | set[str],
                 unknown: UnknownFields) -> None:
    """Refuse the unsupported fields that ask for something; ignore (and log) unknown ones."""
    refuse_unsupported(body, UNSUPPORTED_FIELDS)
    extra = set(body) - own - set(SAMPLING_FIELDS) - INERT_FIELDS - UNSUPPORTED_FIELDS
    if extra:
        unknown.ignore(endpoint, extra)
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise InvalidRequest("best_of other than n is not supported by minisgl")


def response_format_grammar(fmt: Any) -> tuple[str, str] | None:
    """(grammar kind, text) of OpenAI's response_format (None: free text). llama.cpp's
    `{"type": "json_object", "schema": {...}}` constrains to that schema; SGLang's
    `{"type": "structural_tag", ...}` (xgrammar's `format`, or the older `structures` and
    `triggers`) is a structural tag."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is None:
            return "json_schema", '{"type": "object"}'
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.schema must be a JSON schema object")
        return "json_schema", json.dumps(schema)
    if kind == "json_schema":  # {"json_schema": {"name", "schema", "strict"}}, or SGLang's
        spec = fmt.get("json_schema") or fmt  # shorter {"type": "json_schema", "schema": ...}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON "
                                 "object")
        return "json_schema", json.dumps(schema)
    if kind == "structural_tag":
        return "structural_tag", json.dumps(fmt)
    raise InvalidRequest("response_format.type must be text, json_object, json_schema or "
                         "structural_tag")


def structured_output(body: dict[str, Any]) -> tuple[str, str, str] | None:
    """(field, grammar kind, grammar text) of a constraint asked for the other servers' way:
    vLLM's `structured_outputs` ({"json" | "regex" | "grammar" | "choice" | "json_object"})
    or `guided_*`, llama.cpp's `grammar` (GBNF, which xgrammar's EBNF reads); None if none."""
    asked = {name: body[name] for name in GUIDED_FIELDS if not asks_nothing(body.get(name))}
    if not asks_nothing(body.get("guided_whitespace_pattern")):
        raise InvalidRequest("guided_whitespace_pattern is not supported by minisgl")
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest("structured_outputs must be an object")
        for key, value in outputs.items():
            name = f"structured_outputs.{key}"
            if key in STRUCTURED_OUTPUT_KINDS:
                if not asks_nothing(value):
                    asked[name] = value
            elif key not in INERT_STRUCTURED_OPTIONS and not asks_nothing(value):
                raise InvalidRequest(f"{name} is not supported by minisgl")
    if len(asked) > 1:
        raise InvalidRequest(f"give at most one output constraint, got {', '.join(asked)}")
    if not asked:
        return None
    (name, value), = asked.items()
    key = GUIDED_FIELDS.get(name, name.removeprefix("structured_outputs."))
    kind = STRUCTURED_OUTPUT_KINDS[key]
    if kind == "json_object":
        return name, "json_schema", '{"type": "object"}'
    if kind in ("json_schema", "structural_tag") and isinstance(value, dict):
        return name, kind, json.dumps(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise InvalidRequest(f"{name} must be a non-empty list of strings")
        # EBNF string literals take JSON's escapes
        return name, "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                       for c in dict.fromkeys(value))
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string")
    return name, kind, value


def sampling_params(body: dict[str, Any], max_new_tokens: Any,
                    defaults: dict[str, Any] | None = None) -> SamplingParams:
    """`defaults` (the model's generation_config, --sampling-defaults model) fill the
    sampling fields the request leaves out; response_format, structured_outputs, guided_* and
    grammar become the grammar field they ask for (at most one constraint per request)."""
    values = {ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items()
              if body.get(theirs) is not None}
    schema = response_format_grammar(body.get("response_format"))
    if schema is not None:
        kind, text = schema
        if any(values.get(field) not in (None, "", text) for field in GRAMMAR_FIELDS):
            raise InvalidRequest("give either response_format or a grammar field "
                                 f"({', '.join(GRAMMAR_FIELDS)}), not both")
        values[kind] = text
    constraint = structured_output(body)
    if constraint is not None:
        name, kind, text = constraint
        given = [field for field in GRAMMAR_FIELDS if values.get(field) not in (None, "")]
        if given:
            raise InvalidRequest(f"give at most one output constraint, got {name} and "
                                 f"{'response_format' if schema is not None else given[0]}")
        values[kind] = text
    for name, value in (defaults or {}).items():
        values.setdefault(name, value)
    values["max_new_tokens"] = max_new_tokens
    return SamplingParams.from_dict(values)


@dataclass
class StreamOptions:
    """What an answer carries besides its choices."""

    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage: bool = False  # each content chunk with its choice's usage so far
    # return_cached_tokens_details (SGLang's): `sglext.cached_tokens_details`, where a choice ends
    cached_details: bool = False


def stream_options(body: dict[str, Any]) -> StreamOptions:
    cached_details = check_bool(none_as(body.get("return_cached_tokens_details"), False),
                                "return_cached_tokens_details")
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(cached_details=cached_details)
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return StreamOptions(
        check_bool(none_as(options.get("include_usage"), False),
                   "stream_options.include_usage"),
        check_bool(none_as(options.get("continuous_usage_stats"), False),
                   "stream_options.continuous_usage_stats"), cached_details)


def normalize_messages(messages: Any, images: list[str] | None = None
                       ) -> list[dict[str, Any]]:
    """Text content parts joined into one string, which every chat template understands;
    image parts (refused unless `images` is given) marked in it, their sources appended to
    `images`."""
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
            pieces = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in IMAGE_PART_TYPES and images is not None:
                    images.append(image_source(part, f"messages[{len(out)}]"))
                    pieces.append((True, ""))
                elif kind == "text" and isinstance(part.get("text"), str):
                    pieces.append((False, part["text"]))
                else:
                    raise InvalidRequest("content parts must be text or image_url parts, got "
                                         f"{kind or part!r}")
            content = join_parts(pieces)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest("message content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


def split_prefill(messages: list[dict[str, Any]], continue_final: bool
                  ) -> tuple[list[dict[str, Any]], str]:
    """(the messages to apply the template to, the assistant text the answer continues).
    As SGLang: with continue_final_message a trailing assistant message is the start of the
    answer; without it, a trailing assistant message is sent as a user turn."""
    if messages[-1]["role"] != "assistant":
        return messages, ""
    if continue_final:
        return messages[:-1], messages[-1]["content"]
    return [*messages[:-1], {**messages[-1], "role": "user"}], ""


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    kwargs = none_as(body.get("chat_template_kwargs"), {})
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object")
    if "chat_template" in kwargs:
        raise InvalidRequest("chat_template_kwargs.chat_template: a request cannot bring its "
                             "own template (start the server with --chat-template)")
    return kwargs

"""The body of POST /v1/responses (OpenAI's Responses API), read as the chat completion it asks
for: `instructions` and the `input` items become chat messages (after those of the
`previous_response_id` conversation), function tools and `text.format` become the chat's tools
and response_format, so prompts, grammars and tool-call parsing are the chat endpoint's own.
The answer's shapes: responses_results; stored conversations: responses_store."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import UnknownFields, check_int, flag, refuse_unsupported
from minisgl.protocol.image_parts import image_source
from minisgl.protocol.openai_fields import SAMPLING_FIELDS
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_requests import ChatRequest, parse_chat
from minisgl.protocol.responses_store import ResponseStore

# Read here (and turned into the chat body).
OWN_FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "stream",
                        "tools", "tool_choice", "parallel_tool_calls", "text",
                        "previous_response_id", "store", "include", "truncation",
                        "chat_template_kwargs", "priority", "lora_path", "reasoning"})
# Nothing a client sees depends on these.
INERT_FIELDS = frozenset({"metadata", "user", "service_tier", "safety_identifier",
                          "prompt_cache_key", "prompt_cache_retention", "stream_options",
                          "background"})
# Features minisgl lacks: accepted only at their default.
UNSUPPORTED_FIELDS = frozenset({"conversation", "prompt", "top_logprobs",
                                "max_tool_calls", "context_management"})
HOSTED_TOOLS = "web search, file search, code interpreter, computer use, image generation, MCP"
SAMPLING_PASSED = frozenset(SAMPLING_FIELDS) - {"n"}


@dataclass
class ResponsesRequest:
    id: str
    created_at: int
    chat: ChatRequest  # what runs: one chat completion
    messages: list[dict[str, Any]]  # the conversation so far, without the instructions
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    store: bool
    echo: dict[str, Any]  # the request's settings every response object repeats

    @property
    def stream(self) -> bool:
        return self.chat.stream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A message's text: a string, or its text parts (input_text, output_text) joined; with
    `images`, a message with input_image parts is a list of chat parts (text, image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content parts")
    texts, parts = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            parts.append({"type": "image_url", "image_url": {
                "url": image_source(part, where), "detail": part.get("detail")}})
            continue
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            allowed = "input_text, output_text, input_image" if images else \
                "input_text, output_text"
            raise InvalidRequest(f"{where}.content: only {allowed} parts are supported, got "
                                 f"{kind or part!r}")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if len(parts) > len(texts):
        return parts
    return "\n".join(texts)


def input_items(raw: Any) -> list[dict[str, Any]]:
    """`input` as a list of items: a string is one user message; messages without a `type`
    (as the Agents SDK sends them) are messages, their text content a list of parts, as
    /input_items lists them. Each item gets an id if it has none."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("input must be a string or a non-empty list of items")
    items = []
    for k, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{k}] must be an object")
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind)
        if prefix is None:
            raise InvalidRequest(f"input[{k}].type {kind!r} is not supported by minisgl "
                                 "(message, function_call, function_call_output, reasoning)")
        item = {"id": item.get("id") or new_id(prefix), **item, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        items.append(item)
    return items


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content parts (reasoning_text), else its summary's."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise InvalidRequest(f"{where}: a reasoning item's content and summary are lists of "
                             "{\"type\", \"text\"} parts")
    return "\n".join(p["text"] for p in parts)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of input items: a function_call joins the assistant message before it
    (as its tool_calls), its output becomes a `tool` message; a reasoning item's text is the
    next assistant message's `reasoning_content` (templates that keep a tool-calling turn's
    thoughts read it: Qwen3's, and gpt-oss's as its `thinking`; others ignore it)."""
    messages: list[dict[str, Any]] = []
    thought = ""  # reasoning not yet given to an assistant message

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal thought
        if thought and "reasoning_content" not in message:
            message["reasoning_content"], thought = thought, ""
        return message

    for k, item in enumerate(items):
        where, kind = f"input[{k}]", item["type"]
        if kind == "reasoning":
            thought = "\n".join(filter(None, (thought, _reasoning_text(item, where))))
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{where}.role must be user, assistant, system or "
                                     f"developer, got {role!r}")
            message = {"role": role, "content": _text_of(item.get("content"), where,
                                                         images=role == "user")}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "function_call":
            name, arguments, call_id = (item.get("name"), item.get("arguments"),
                                        item.get("call_id"))
            if not all(isinstance(v, str) and v for v in (name, call_id)) or not isinstance(
                    arguments, str):
                raise InvalidRequest(f"{where}: a function_call needs call_id, name and "
                                     "arguments (a JSON string)")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                assistant(last).setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": "",
                                           "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequest(f"{where}: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(output, where) if output is not None else ""})
    return messages


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat tools; hosted tools are refused by name."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list")
    out = []
    for k, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(f"tools[{k}]: tool type {kind!r} is not supported by minisgl "
                                 f"(function tools only; no {HOSTED_TOOLS})")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                    if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise InvalidRequest(f"tool_choice {kind!r} is not supported by minisgl (none, auto, "
                         "required or {\"type\": \"function\", \"name\": ...})")


def _response_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the chat's response_format, the `text` object a response repeats)."""
    if text is None:
        return None, {"format": {"type": "text"}}
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(text, dict) and text.get("verbosity") not in (None, "medium"):
        raise InvalidRequest("text.verbosity is not supported by minisgl")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None, {"format": fmt}
    if kind == "json_object":
        return {"type": "json_object"}, {"format": fmt}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format.schema must be a JSON schema object")
        return ({"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                        "schema": fmt["schema"]}},
                {"format": fmt})
    raise InvalidRequest("text.format.type must be text, json_object or json_schema")


def _check_fields(body: dict[str, Any], unknown: UnknownFields) -> None:
    refuse_unsupported(body, UNSUPPORTED_FIELDS)
    if flag(body, "background"):
        raise InvalidRequest("background is not supported by minisgl (responses run while "
                             "the request waits or streams)")
    include = body.get("include") or []
    if not isinstance(include, list) or include:
        raise InvalidRequest(f"include {include!r} is not supported by minisgl (only [])")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidRequest("truncation 'auto' is not supported by minisgl (an input longer "
                             "than the context is refused)")
    extra = set(body) - OWN_FIELDS - INERT_FIELDS - UNSUPPORTED_FIELDS - SAMPLING_PASSED
    if extra:
        unknown.ignore("/v1/responses", extra)


def _reasoning_effort(reasoning: Any) -> str | None:
    """reasoning.effort (read by harmony models, as chat's reasoning_effort); a summary is
    refused ({"effort": null, "summary": null} asks for nothing)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise InvalidRequest("reasoning must be an object {\"effort\", \"summary\"}")
    if reasoning.get("summary") is not None:
        raise InvalidRequest("reasoning.summary is not supported by minisgl (the reasoning is "
                             "returned whole)")
    return reasoning.get("effort")


def parse_responses(body: dict[str, Any], model: OpenAIModel, store: ResponseStore,
                    template_takes_tools: bool, max_sequences: int, unknown: UnknownFields
                    ) -> ResponsesRequest:
    _check_fields(body, unknown)
    previous_id = body.get("previous_response_id")
    history = store.conversation(previous_id) if previous_id is not None else []
    items = input_items(body.get("input"))
    messages = history + items_to_messages(items)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions must be a string")
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        check_int(max_output, "max_output_tokens", 1)
    response_format, text = _response_format(body.get("text"))
    response_id = new_id("resp")
    chat_body = {key: body[key] for key in SAMPLING_PASSED | {"model", "stream", "priority",
                                                              "lora_path", "parallel_tool_calls",
                                                              "chat_template_kwargs"}
                 if body.get(key) is not None}
    chat_body.update(
        messages=([{"role": "system", "content": instructions}] if instructions else [])
        + messages, max_tokens=max_output, tools=_chat_tools(body.get("tools")),
        tool_choice=_chat_tool_choice(body.get("tool_choice")),
        response_format=response_format, rid=response_id,
        reasoning_effort=_reasoning_effort(body.get("reasoning")))
    chat = parse_chat({k: v for k, v in chat_body.items() if v is not None}, model,
                      template_takes_tools, max_sequences, unknown)
    params = chat.prompts[0].params
    echo = {"instructions": instructions, "max_output_tokens": max_output, "model": chat.model,
            "parallel_tool_calls": chat.tools.parallel if chat.tools else
            flag(body, "parallel_tool_calls", True),
            "previous_response_id": previous_id,
            "reasoning": {"effort": chat_body["reasoning_effort"], "summary": None},
            "store": flag(body, "store", True), "temperature": params.temperature,
            "text": text, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "top_p": params.top_p, "truncation": "disabled",
            "user": body.get("user"), "metadata": body.get("metadata") or {},
            "background": False}
    return ResponsesRequest(response_id, int(time.time()), chat, messages, items,
                            echo["store"], echo)


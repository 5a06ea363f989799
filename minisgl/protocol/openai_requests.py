"""The bodies of /v1/completions and /v1/chat/completions, parsed into prompts. Which fields are
read, ignored or refused: openai_fields; the answers: openai_results."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from minisgl.core import GRAMMAR_FIELDS
from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import (UnknownFields, check_adapter_name, check_int, check_priority,
                                     flag, ids_prompts, text_prompts)
from minisgl.protocol.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_TOP_LOGPROBS,
                                            StreamOptions, chat_template_kwargs, check_fields,
                                            normalize_messages, sampling_params, split_prefill,
                                            stream_options)
from minisgl.protocol.harmony import (harmony_grammar, harmony_messages, harmony_params,
                                      harmony_reasoning, reasoning_effort)
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_tools import (PARSER_STYLES, SPECIAL_TOKEN_STYLES, ToolUse,
                                          parse_tool_use, render_tools)
from minisgl.protocol.reasoning import (SPECIAL_TOKEN_PARSERS, Reasoning, markers,
                                        request_reasoning)
from minisgl.runtime import ChatPrompt, Prompt
from minisgl.scheduler import expand_samples


def _rid(rid: Any, prefix: str) -> str:
    if rid is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest("rid must be a non-empty string")
    return rid


def _name_samples(groups: list[list[Prompt]], rid: str) -> list[Prompt]:
    """The sequences in order, the k-th named `{rid}-{k}`."""
    flat = [p for g in groups for p in g]
    for k, p in enumerate(flat):
        p.rid = f"{rid}-{k}"
    return flat


# ---- /v1/completions ---------------------------------------------------------------------------

@dataclass
class CompletionRequest:
    model: str  # the name the answer reports
    rid: str
    groups: list[list[Prompt]]  # per prompt, its n samples
    prompts: list[Prompt]  # the sequences to submit, in answer order
    stream: bool
    options: StreamOptions
    echo: bool  # the answer starts with the prompt
    echo_logprobs: bool  # ... and its logprobs start with the prompt's


def _completion_prompts(raw: Any) -> list[Prompt]:
    prompts = text_prompts(raw) or ids_prompts(raw)
    if prompts is None:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of such lists (non-empty)")
    return prompts[1]


def parse_completion(body: dict[str, Any], model: OpenAIModel, max_sequences: int,
                     unknown: UnknownFields) -> CompletionRequest:
    check_fields(body, "/v1/completions", COMPLETION_FIELDS, unknown)
    name, adapter = model.resolve(body)
    adapter = adapter or check_adapter_name(body.get("lora_path"))
    prompts = _completion_prompts(body.get("prompt"))
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
        p.lora = adapter
    rid = _rid(body.get("rid"), "cmpl")
    groups = expand_samples(prompts, max_sequences)
    return CompletionRequest(name, rid, groups, _name_samples(groups, rid), stream, options,
                             echo, echo_logprobs)


# ---- /v1/chat/completions ----------------------------------------------------------------------

@dataclass
class ChatRequest:
    model: str  # the name the answer reports
    rid: str
    groups: list[list[Prompt]]  # the prompt's n samples, one group
    prompts: list[Prompt]  # the sequences to submit, in answer order
    tools: ToolUse | None
    stream: bool
    options: StreamOptions
    reasoning: Reasoning | None = None  # how the answer's reasoning is split out (None: not)


def parse_chat(body: dict[str, Any], model: OpenAIModel, template_takes_tools: bool,
               max_sequences: int, unknown: UnknownFields) -> ChatRequest:
    check_fields(body, "/v1/chat/completions", CHAT_FIELDS, unknown)
    name, adapter = model.resolve(body)
    adapter = adapter or check_adapter_name(body.get("lora_path"))
    continue_final = flag(body, "continue_final_message")
    generation_prompt = flag(body, "add_generation_prompt", True)
    if continue_final and generation_prompt and body.get("add_generation_prompt"):
        raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                             "be true: set add_generation_prompt to false to continue the "
                             "final message")
    images: list[str] = []
    messages, prefix = split_prefill(normalize_messages(body.get("messages"), images),
                                     continue_final)
    template_kwargs = {**chat_template_kwargs(body), "add_generation_prompt": generation_prompt}
    reasoning, thinking = None, False
    if model.harmony:
        messages = harmony_messages(messages)
        reasoning = harmony_reasoning(body)
        effort = reasoning_effort(body.get("reasoning_effort"))
        if effort is not None:
            template_kwargs["reasoning_effort"] = effort
    elif body.get("reasoning_effort") is not None:
        raise InvalidRequest("reasoning_effort is read by harmony models only (gpt-oss, "
                             "--reasoning-parser gpt-oss)")
    elif model.reasoning_parser is not None or any(
            name in body for name in ("separate_reasoning", "stream_reasoning")):
        first = messages[0] if messages else {}
        system = (first.get("content") if first.get("role") == "system"
                  and isinstance(first.get("content"), str) else None)
        reasoning, thinking = request_reasoning(body, model.reasoning_parser,
                                                model.template_thinking(system), template_kwargs,
                                                prefix)
    tools = (parse_tool_use(body) if any(body.get(name) is not None for name in
                                         ("tools", "tool_choice", "parallel_tool_calls"))
             else None)
    if tools is not None:
        messages, extra = render_tools(messages, tools, template_takes_tools)
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
    params = sampling_params(body, max_tokens, model.sampling_defaults)
    grammar = (harmony_grammar(tools, params.grammar) if model.harmony
               else tools.grammar(model.tool_call_parser, params.grammar) if tools is not None
               else params.grammar)
    if grammar != params.grammar:
        for name in GRAMMAR_FIELDS:
            setattr(params, name, None)
        setattr(params, *grammar)
    if model.harmony:
        harmony_params(params)
    elif (tools is not None and tools.choice == "auto"
          and PARSER_STYLES[model.tool_call_parser] in SPECIAL_TOKEN_STYLES) or (
            reasoning is not None and reasoning.parser in SPECIAL_TOKEN_PARSERS):
        params.skip_special_tokens = params.spaces_between_special_tokens = False
    if thinking and params.grammar is not None:
        # NOTE: the reasoning is free text, the answer is not
        params.grammar_after = markers(model.reasoning_parser)[1]
    chat = ChatPrompt(messages, template_kwargs, prefix)
    prompt = Prompt([], params, logprob_num=(top or 0) if logprobs else -1,
                    priority=check_priority(body.get("priority")), chat=chat, lora=adapter,
                    image_data=images or None)
    rid = _rid(body.get("rid"), "chatcmpl")
    groups = expand_samples([prompt], max_sequences)
    return ChatRequest(name, rid, groups, _name_samples(groups, rid), tools, stream, options,
                       reasoning)

"""/tokenize and /detokenize (also under /v1/), in the shapes vLLM's and SGLang's clients read.

/tokenize takes `prompt` (a string, or SGLang's list of strings) or `messages` (rendered as a
chat completion would be, tools included) and answers `{"tokens", "count", "max_model_len"}`,
plus `token_strs` when `return_token_strs` asks (vLLM). /detokenize takes `tokens` (ids, or a
list of such lists) and answers the text under both names clients read: `prompt` (vLLM) and
`text` (SGLang)."""

from __future__ import annotations

from typing import Any

from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import UnknownFields, flag, is_ids
from minisgl.protocol.openai_fields import (chat_template_kwargs, normalize_messages,
                                            split_prefill)
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_tools import parse_tool_use, render_tools
from minisgl.runtime.tokenizer import Tokenizer

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens",
                             "add_generation_prompt", "continue_final_message",
                             "chat_template_kwargs", "tools", "tool_choice",
                             "parallel_tool_calls", "return_token_strs", "reasoning_effort",
                             "mm_processor_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens", "skip_special_tokens"})


def _need_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer (it was started from a config "
                             "without one)")
    return tokenizer


async def tokenize(body: dict[str, Any], tokenizer: Tokenizer | None, model: OpenAIModel,
                   unknown: UnknownFields) -> dict[str, Any]:
    tokenizer = _need_tokenizer(tokenizer)
    model.resolve(body)
    unknown.ignore("/tokenize", set(body) - TOKENIZE_FIELDS)
    for name in ("reasoning_effort", "mm_processor_kwargs"):
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is not supported by minisgl")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give exactly one of prompt or messages")
    context_len = model.context_len
    if messages is not None:
        ids: Any = await _chat_ids(body, tokenizer, context_len)
        count: Any = len(ids)
    else:
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
            raise InvalidRequest("prompt must be a string or a non-empty list of strings")
        special = flag(body, "add_special_tokens", True)
        for text in texts:
            tokenizer.check_length(len(text), context_len)
        encoded = tokenizer.hf(texts, add_special_tokens=special)["input_ids"]
        ids, count = ((encoded[0], len(encoded[0])) if single
                      else (encoded, [len(e) for e in encoded]))
    answer = {"tokens": ids, "count": count, "max_model_len": context_len}
    if flag(body, "return_token_strs"):
        pieces = tokenizer.hf.convert_ids_to_tokens
        answer["token_strs"] = (pieces(ids) if ids and isinstance(ids[0], int)
                                else [pieces(x) for x in ids])
    return answer


async def _chat_ids(body: dict[str, Any], tokenizer: Tokenizer, context_len: int
                    ) -> list[int]:
    """The ids a chat completion with these messages would prefill (vLLM: the template's
    text, special tokens not added again unless add_special_tokens asks)."""
    continue_final = flag(body, "continue_final_message")
    generation_prompt = flag(body, "add_generation_prompt", not continue_final)
    if continue_final and generation_prompt:
        raise InvalidRequest("add_generation_prompt and continue_final_message cannot both "
                             "be true")
    messages, prefix = split_prefill(normalize_messages(body.get("messages")), continue_final)
    kwargs = {**chat_template_kwargs(body), "add_generation_prompt": generation_prompt}
    tools = parse_tool_use(body)
    if tools is not None:
        messages, extra = render_tools(messages, tools, tokenizer.takes_tools)
        kwargs.update(extra)
    ids = await tokenizer.encode_chat(messages, context_len, kwargs, prefix)
    if flag(body, "add_special_tokens"):
        ids = tokenizer.hf.build_inputs_with_special_tokens(ids)
    return ids


def detokenize(body: dict[str, Any], tokenizer: Tokenizer | None, model: OpenAIModel,
               unknown: UnknownFields) -> dict[str, Any]:
    tokenizer = _need_tokenizer(tokenizer)
    model.resolve(body)
    unknown.ignore("/detokenize", set(body) - DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    skip = flag(body, "skip_special_tokens", True)
    vocab = len(tokenizer.hf)
    single = is_ids(tokens)
    batch = [tokens] if single else tokens
    if not (isinstance(batch, list) and all(is_ids(ids) for ids in batch)):
        raise InvalidRequest("tokens must be a list of token ids or a list of such lists")
    for ids in batch:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"tokens: {bad} is not a token id of this model (0 .. "
                                 f"{vocab - 1})")
    texts = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in batch]
    text: Any = texts[0] if single else texts
    return {"prompt": text, "text": text}

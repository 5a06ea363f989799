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
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_requests import parse_chat
from minisgl.runtime import RequestManager
from minisgl.runtime.tokenizer import Tokenizer

# the chat fields that shape a prompt (the others, sampling, are a chat completion's business)
CHAT_PROMPT_FIELDS = frozenset({"model", "messages", "add_generation_prompt",
                                "continue_final_message", "chat_template_kwargs", "tools",
                                "tool_choice", "parallel_tool_calls", "reasoning_effort"})
TOKENIZE_FIELDS = CHAT_PROMPT_FIELDS | {"prompt", "add_special_tokens", "return_token_strs",
                                        "mm_processor_kwargs"}
DETOKENIZE_FIELDS = frozenset({"model", "tokens", "skip_special_tokens"})


def _need_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer (it was started from a config "
                             "without one)")
    return tokenizer


async def tokenize(body: dict[str, Any], requests: RequestManager, model: OpenAIModel,
                   unknown: UnknownFields) -> dict[str, Any]:
    tokenizer = _need_tokenizer(requests.tokenizer)
    model.resolve(body)
    unknown.ignore("/tokenize", set(body) - TOKENIZE_FIELDS)
    if body.get("mm_processor_kwargs") is not None:
        raise InvalidRequest("mm_processor_kwargs is not supported by minisgl")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequest("give exactly one of prompt or messages")
    if messages is not None:
        # NOTE: the ids a chat completion with these messages prefills (the template holds any
        # BOS; add_special_tokens adds them again, as vLLM)
        chat = parse_chat({k: v for k, v in body.items() if k in CHAT_PROMPT_FIELDS}, model,
                          tokenizer.takes_tools, 1, unknown).prompts[0].chat
        ids: Any = await requests.encode_chat(chat)
        if flag(body, "add_special_tokens"):
            ids = tokenizer.hf.build_inputs_with_special_tokens(ids)
        count: Any = len(ids)
    else:
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
            raise InvalidRequest("prompt must be a string or a non-empty list of strings")
        encoded = await requests.encode(texts, flag(body, "add_special_tokens", True))
        ids, count = ((encoded[0], len(encoded[0])) if single
                      else (encoded, [len(e) for e in encoded]))
    answer = {"tokens": ids, "count": count, "max_model_len": model.context_len}
    if flag(body, "return_token_strs"):
        pieces = tokenizer.hf.convert_ids_to_tokens
        answer["token_strs"] = (pieces(ids) if ids and isinstance(ids[0], int)
                                else [pieces(x) for x in ids])
    return answer


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

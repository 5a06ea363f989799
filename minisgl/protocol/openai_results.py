"""The answers of /v1/completions and /v1/chat/completions: one JSON body once every choice
finished, or a stream's chunk objects (each choice's text as deltas, its finish_reason once it
ended, a usage chunk if asked). A Cursor per choice remembers what a stream has sent, so each
chunk costs only what is new."""

from __future__ import annotations

import time
from typing import Any

from minisgl.protocol.harmony import HarmonyParser
from minisgl.protocol.openai_fields import StreamOptions
from minisgl.protocol.openai_logprobs import Cursor, chat_logprobs, completion_logprobs
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.protocol.openai_requests import ChatRequest, CompletionRequest
from minisgl.protocol.openai_pythonic import PythonicCallParser
from minisgl.protocol.openai_tool_parser import ToolCallParser
from minisgl.protocol.reasoning import ReasoningParser
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import Prompt, ReqHandle
from minisgl.runtime.tokenizer import Tokenizer


def openai_finish_reason(reason: dict[str, Any] | None) -> str | None:
    return None if reason is None else reason.get("type")


def matched_stop(reason: dict[str, Any] | None) -> Any:
    return reason.get("matched") if reason and reason.get("type") == "stop" else None


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class _Answer:
    """What completions and chat answers share: the head every body and chunk starts with,
    usage, and the stream's chunk framing around each endpoint's `_choice`."""

    def __init__(self, head: dict[str, Any], groups: list[list[Prompt]],
                 handles: list[ReqHandle], options: StreamOptions, tokens: TokenTexts) -> None:
        self.head, self.handles, self.options, self.tokens = head, handles, options, tokens
        starts, at = [], 0
        for group in groups:
            starts.append(at)
            at += len(group)
        self._group_starts = starts
        self._no_usage = ({"usage": None} if options.include_usage or options.continuous_usage
                          else {})
        self.cursors = [Cursor() for _ in handles]

    def usage(self) -> dict[str, int]:
        """A prompt sampled n times counts its tokens once, as OpenAI does."""
        return _usage(sum(len(self.handles[i].prompt_ids) for i in self._group_starts),
                      sum(len(h.output_ids) for h in self.handles))

    def sglext(self, handles: list[ReqHandle] | None = None) -> dict[str, Any]:
        """With return_cached_tokens_details: SGLang's `sglext` of `handles` (each prompt once
        by default, as usage counts it)."""
        if not self.options.cached_details:
            return {}
        if handles is None:
            handles = [self.handles[i] for i in self._group_starts]
        each = [h.cached_tokens_details for h in handles]
        details: dict[str, Any] = {name: sum(d[name] for d in each)
                                   for name in ("device", "host", "storage")}
        details["storage_backend"] = next(
            (d["storage_backend"] for d in each if d["storage_backend"]), None)
        return {"sglext": {"cached_tokens_details": details}}

    def stream_first(self) -> list[dict[str, Any]]:
        return []

    def stream_chunk(self, k: int, h: ReqHandle) -> dict[str, Any] | None:
        """Choice k's news as one chunk; None when there is nothing to send (e.g. half a UTF-8
        character so far, or text held back as a possible tool call's start)."""
        c = self.cursors[k]
        if (len(h.text) == c.chars and not c.prefix and not h.finished
                and (h.logprob_num < 0 or len(h.token_logprobs) == c.tokens)):
            return None
        choice = self._choice(k, h, c)
        if choice is None:
            return None
        extra = ({"usage": _usage(len(h.prompt_ids), len(h.output_ids))}
                 if self.options.continuous_usage else self._no_usage)
        if h.finished:
            extra = {**extra, **self.sglext([h])}
        return {**self.head, "choices": [choice], **extra}

    def stream_last(self) -> list[dict[str, Any]]:
        if not self.options.include_usage:
            return []
        return [{**self.head, "choices": [], "usage": self.usage()}]

    def _choice(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionAnswer(_Answer):
    def __init__(self, req: CompletionRequest, handles: list[ReqHandle], tokens: TokenTexts,
                 tokenizer: Tokenizer | None) -> None:
        head = {"id": req.rid, "object": "text_completion", "created": int(time.time()),
                "model": req.model}
        super().__init__(head, req.groups, handles, req.options, tokens)
        for cursor, p in zip(self.cursors, req.prompts):
            cursor.prompt_logprobs = req.echo_logprobs
            if req.echo:
                # NOTE: special tokens kept, so the text agrees with the echoed logprob tokens
                cursor.prefix = (p.text if p.text is not None else
                                 tokenizer.decode(p.input_ids, skip_special_tokens=False)
                                 if tokenizer else "")

    def body(self) -> dict[str, Any]:
        choices = [self._choice(k, h, c)
                   for k, (h, c) in enumerate(zip(self.handles, self.cursors))]
        return {**self.head, "choices": choices, "usage": self.usage(), **self.sglext()}

    def _choice(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
        """What the client has not been sent yet of choice k; advances the cursor."""
        text = h.text
        reason = openai_finish_reason(h.finish_reason) if h.finished else None
        choice: dict[str, Any] = {"index": k, "text": cursor.prefix + text[cursor.chars:],
                                  "logprobs": None, "finish_reason": reason}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        if h.logprob_num >= 0:
            choice["logprobs"] = completion_logprobs(self.tokens, h, cursor)
        cursor.chars, cursor.prefix = len(text), ""
        return choice


class ChatAnswer(_Answer):
    """Chat answers. With --reasoning-parser (and separate_reasoning) each choice's text is
    split first (protocol.reasoning): the message's `reasoning_content` (null when there is
    none) and a stream's `delta.reasoning_content` (null in deltas without any, as SGLang's),
    then `content`, which alone the tool-call parser reads. A harmony answer (gpt-oss) is read
    by one parser for all three (protocol.harmony)."""

    def __init__(self, req: ChatRequest, handles: list[ReqHandle], model: OpenAIModel,
                 tokens: TokenTexts) -> None:
        head = {"id": req.rid, "object": "chat.completion.chunk" if req.stream
                else "chat.completion", "created": int(time.time()), "model": req.model}
        super().__init__(head, req.groups, handles, req.options, tokens)
        self.tools, self.parser_name, self.reasoning = (req.tools, model.tool_call_parser,
                                                        req.reasoning)
        self.harmony = model.harmony
        self.prefixes = [p.chat.prefix if p.chat else "" for p in req.prompts]
        # a stream's parsers per choice: reasoning, tool calls; and the content sent so far
        self._reasoners: dict[int, ReasoningParser] = {}
        self._parsers: dict[int, ToolCallParser | PythonicCallParser | HarmonyParser] = {}
        self._content_sent: dict[int, int] = {}

    def body(self) -> dict[str, Any]:
        choices = []
        for k, h in enumerate(self.handles):
            message, reason = self._message(k, h)
            choices.append({
                "index": k, "message": message,
                "logprobs": (chat_logprobs(self.tokens, h, Cursor()) if h.logprob_num >= 0
                             else None),
                "finish_reason": reason, "matched_stop": matched_stop(h.finish_reason)})
        return {**self.head, "choices": choices, "usage": self.usage(), **self.sglext()}

    def _message(self, k: int, h: ReqHandle) -> tuple[dict[str, Any], str | None]:
        """A finished choice's message and finish_reason ("tool_calls" when it called and
        stopped by itself), read by the same parsers a stream uses."""
        if self.harmony:
            return self._harmony_message(k, h)
        reasoning, text = None, h.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.new_parser().parse(h.text)
        message: dict[str, Any] = {"role": "assistant", "content": text,
                                   "reasoning_content": reasoning}
        reason = openai_finish_reason(h.finish_reason)
        if self.tools is not None:
            parser = self.tools.parser(self.parser_name)
            message["content"], calls = parser.parse(text)
            if calls:
                message["tool_calls"] = calls
            reason = parser.finish_reason(reason)
        if reasoning and not message["content"]:
            message["content"] = None  # NOTE: as SGLang: only thoughts, no answer
        return message, reason

    def _harmony_parser(self, k: int) -> HarmonyParser:
        tools = self.tools
        return HarmonyParser(set(tools.names) if tools else set(),
                             one_call=tools is not None and not tools.parallel,
                             separate_reasoning=self.reasoning is not None,
                             stream_reasoning=self.reasoning is None or self.reasoning.stream,
                             prefix=self.prefixes[k])

    def _harmony_message(self, k: int, h: ReqHandle) -> tuple[dict[str, Any], str | None]:
        parser = self._harmony_parser(k)
        reasoning, content, calls = parser.parse(h.text)
        message: dict[str, Any] = {"role": "assistant", "content": content,
                                   "reasoning_content": reasoning}
        if calls:
            message["tool_calls"] = calls
        return message, parser.finish_reason(openai_finish_reason(h.finish_reason))

    def stream_first(self) -> list[dict[str, Any]]:
        """The role comes first, alone, for each choice."""
        return [{**self.head, "choices": [{"index": k, "delta": {"role": "assistant",
                                                                   "content": "",
                                                                   "reasoning_content": None},
                                           "logprobs": None, "finish_reason": None}],
                 **self._no_usage} for k in range(len(self.handles))]

    def _split(self, k: int, h: ReqHandle) -> tuple[str, str]:
        """(the reasoning choice k's text adds, its content so far); a harmony text is split
        by its own parser."""
        if self.reasoning is None or self.harmony:
            return "", h.text
        if k not in self._reasoners:
            self._reasoners[k] = self.reasoning.new_parser()
        parser = self._reasoners[k]
        reasoning = parser.feed(h.text).reasoning
        if h.finished:
            reasoning += parser.finish().reasoning
        return reasoning, parser.content

    def _choice(self, k: int, h: ReqHandle, cursor: Cursor) -> dict[str, Any] | None:
        """What choice k's text adds, as a delta: reasoning_content, then content (with tools:
        content and tool calls as openai_tool_parser reads them; harmony: all three as
        protocol.harmony reads them)."""
        reasoning, content = self._split(k, h)
        cursor.chars = len(h.text)
        delta: dict[str, Any] = {}
        if self.tools is None and not self.harmony:
            if len(content) > self._content_sent.get(k, 0):
                delta["content"] = content[self._content_sent.get(k, 0):]
            self._content_sent[k] = len(content)
            reason = openai_finish_reason(h.finish_reason)
        else:
            if k not in self._parsers:
                self._parsers[k] = (self._harmony_parser(k) if self.harmony
                                    else self.tools.parser(self.parser_name))
            parser = self._parsers[k]
            new = parser.feed(content)
            if h.finished:
                new += parser.finish()
            reasoning += getattr(new, "reasoning", "")
            if new.content:
                delta["content"] = new.content
            if new.tool_calls:
                delta["tool_calls"] = new.tool_calls
            reason = parser.finish_reason(openai_finish_reason(h.finish_reason))
        logprobs = chat_logprobs(self.tokens, h, cursor) if h.logprob_num >= 0 else None
        if (not delta and not reasoning and not h.finished
                and not (logprobs and logprobs["content"])):
            return None  # held back (a marker or call that may be starting), no new token
        delta["reasoning_content"] = reasoning or None
        choice: dict[str, Any] = {"index": k, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": reason if h.finished else None}
        if h.finished:
            choice["matched_stop"] = matched_stop(h.finish_reason)
        return choice

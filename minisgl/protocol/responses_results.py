"""The answers of POST /v1/responses: a response object, or its stream of typed events in
OpenAI's order (response.created, .in_progress; per output item: output_item.added, its
content part / text or argument deltas and their .done events, output_item.done; then
response.completed or response.incomplete). Output comes from the chat answer underneath:
its reasoning_content becomes a reasoning item, its content a message, each tool call a
function_call item."""

from __future__ import annotations

import time
from typing import Any

from minisgl.protocol.openai_results import ChatAnswer
from minisgl.protocol.responses import ResponsesRequest, new_id
from minisgl.protocol.responses_store import StoredResponse
from minisgl.runtime import ReqHandle
from minisgl.runtime.tokenizer import Tokenizer


def _message_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseAnswer:
    """One response: its object, and the events of its stream (a cursor over the chat
    answer's deltas: one output item open at a time)."""

    def __init__(self, req: ResponsesRequest, handle: ReqHandle, chat: ChatAnswer,
                 tokenizer: Tokenizer | None) -> None:
        self.req, self.handle, self.chat, self.tokenizer = req, handle, chat, tokenizer
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._sequence = 0

    # ---- the response object -----------------------------------------------------------------

    def _status(self) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """(status, incomplete_details, error), as OpenAI reports a length cut (SGLang: an
        aborted request failed)."""
        h = self.handle
        if not h.finished:
            return "in_progress", None, None
        reason = h.finish_reason or {}
        if reason.get("type") == "length":
            return "incomplete", {"reason": "max_output_tokens"}, None
        if reason.get("type") == "abort":
            return "failed", None, {"code": "server_error",
                                    "message": reason.get("message") or "aborted"}
        return "completed", None, None

    def _usage(self) -> dict[str, Any]:
        h = self.handle
        thoughts = "".join(item["content"][0]["text"] for item in self.output
                           if item["type"] == "reasoning")
        # NOTE: the reasoning text re-encoded: its tokens as the model would read them back
        reasoning = (len(self.tokenizer.hf(thoughts, add_special_tokens=False)["input_ids"])
                     if thoughts and self.tokenizer is not None else 0)
        return {"input_tokens": len(h.prompt_ids),
                "input_tokens_details": {"cached_tokens": h.cached_tokens},
                "output_tokens": len(h.output_ids),
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": len(h.prompt_ids) + len(h.output_ids)}

    def response(self) -> dict[str, Any]:
        status, incomplete, error = self._status()
        finished = self.handle.finished
        return {"id": self.req.id, "object": "response", "created_at": self.req.created_at,
                "status": status, "error": error, "incomplete_details": incomplete,
                **self.req.echo, "output": [_snapshot(item) for item in self.output],
                "usage": self._usage() if finished else None,
                "completed_at": int(time.time()) if status == "completed" else None}

    def body(self) -> dict[str, Any]:
        """The finished response (the chat answer's message as output items)."""
        choice = self.chat.body()["choices"][0]
        message, item_status = choice["message"], self._item_status()
        if message.get("reasoning_content"):
            self.output.append(_reasoning_item(message["reasoning_content"], item_status))
        if message.get("content") or not message.get("tool_calls"):
            self.output.append(_message_item(message.get("content") or "", item_status))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            self.output.append(_call_item(call["id"], function["name"], function["arguments"],
                                          item_status))
        return self.response()

    def _item_status(self) -> str:
        return "completed" if self._status()[0] == "completed" else "incomplete"

    def stored(self, response: dict[str, Any]) -> StoredResponse:
        """The finished `response` with its conversation: the input's, then what it said."""
        answer: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "message":
                answer["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":  # as a reasoning item sent back would be read
                answer["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "function_call":
                answer.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return StoredResponse(response, [*self.req.messages, answer],
                              self.req.input_items)

    # ---- the stream --------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def stream_first(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def stream_events(self, k: int, h: ReqHandle) -> list[dict[str, Any]]:
        chunk = self.chat.stream_chunk(k, h)
        if chunk is None or not chunk["choices"]:
            return []
        delta = chunk["choices"][0]["delta"]
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Text for a message or reasoning item: opens the item if another one is open."""
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item = (_message_item if kind == "message" else _reasoning_item)("", "in_progress")
            events += self._add(item)
            if kind == "message":
                events.append(self._event("response.content_part.added",
                                          **self._where(item, content=True),
                                          part=dict(item["content"][0])))
        item = self._open
        if text:
            item["content"][0]["text"] += text
            name = "output_text" if kind == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(f"response.{name}.delta",
                                      **self._where(item, content=True), delta=text, **extra))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call delta: its header opens a function_call item, pieces of its arguments
        follow."""
        events = []
        if "id" in call:
            events += self._close()
            item = _call_item(call["id"], call["function"]["name"], "", "in_progress")
            self._calls[call["index"]] = item
            events += self._add(item)
        item = self._calls[call["index"]]
        piece = (call.get("function") or {}).get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      **self._where(item), delta=piece))
        return events

    def _where(self, item: dict[str, Any], content: bool = False) -> dict[str, Any]:
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        return {**where, "content_index": 0} if content else where

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=_snapshot(item))]

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed" if self._status()[0] in ("completed",
                                                              "in_progress") else "incomplete"
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done",
                                      **self._where(item), name=item["name"],
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(f"response.{name}.done", **self._where(item, True),
                                      text=part["text"], **extra))
            if item["type"] == "message":
                events.append(self._event("response.content_part.done",
                                          **self._where(item, True), part=dict(part)))
        events.append(self._event("response.output_item.done",
                                  output_index=self.output.index(item), item=_snapshot(item)))
        return events

    def stream_last(self) -> list[dict[str, Any]]:
        """The open item closed, then the finished response."""
        # nothing was said: an empty message, as a body has
        events = self._text("message", "") if not self.output else []
        events += self._close()
        status = self._status()[0]
        kind = {"completed": "response.completed",
                "incomplete": "response.incomplete"}.get(status, "response.failed")
        return events + [self._event(kind, response=self.response())]


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """The item as it stands (later deltas must not change an event already built)."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out

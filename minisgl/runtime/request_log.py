"""`--log-requests`: one line per finished request (SGLang's flag and levels).

Level 0 logs what a request was, never what it said: its rid, lengths, cached tokens, TTFT,
end-to-end latency and finish reason. Level 1 adds the sampling parameters, level 2 the prompt
and output text cut to 2048 characters, level 3 all of it. `text` lines go through the logging
setup (stderr, with a timestamp); `json` lines go to stdout alone, one JSON object each.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
from typing import Any

import orjson

PARTIAL_CHARS = 2048  # level 2
TEXTS = ("prompt", "output")  # always JSON-quoted in text lines
PLAIN = re.compile(r"[\w.:/-]+")


class RequestLog:
    def __init__(self, level: int, fmt: str, decode: Any = None) -> None:
        """`decode(ids) -> str` gives the prompt text at levels 2 and 3."""
        self.level, self.fmt, self.decode = level, fmt, decode
        self.logger = logging.getLogger("minisgl.requests")
        if fmt == "json":
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self.logger.handlers = [handler]
            self.logger.propagate = False
        self.logger.setLevel(logging.INFO)

    def finished(self, handle: Any) -> None:
        """`handle`: a finished manager.ReqHandle (not imported: the manager imports us)."""
        record = self.record(handle)
        if self.fmt == "json":
            self.logger.info(_json(record))
        else:  # the log line's own timestamp stands for `time`
            self.logger.info("finished %s", " ".join(
                f"{k}={_json(v) if k in TEXTS else _text(v)}" for k, v in record.items()
                if k not in ("event", "time")))

    def record(self, handle: Any) -> dict[str, Any]:
        end = handle.finished_at or time.perf_counter()
        ttft = None if handle.first_token_at is None else handle.first_token_at - handle.created
        reason = handle.finish_reason or {}
        record: dict[str, Any] = {
            "event": "request.finished", "time": round(time.time(), 3), "rid": handle.rid,
            "is_streaming": handle.streaming, "prompt_tokens": len(handle.prompt_ids),
            "completion_tokens": len(handle.output_ids), "cached_tokens": handle.cached_tokens,
            "ttft": None if ttft is None else round(ttft, 4),
            "e2e_latency": round(end - handle.created, 4),
            "finish_reason": reason.get("type"),
        }
        if reason.get("type") == "abort":
            record["abort_message"] = reason.get("message")
        if self.level >= 1 and handle.params is not None:
            record["sampling_params"] = dataclasses.asdict(handle.params)
        if self.level >= 2:
            limit = None if self.level >= 3 else PARTIAL_CHARS
            prompt = self.decode(handle.prompt_ids) if self.decode else handle.prompt_ids
            record["prompt"] = prompt[:limit] if limit else prompt
            record["output"] = handle.text[:limit] if limit else handle.text
        return record


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


def _text(value: Any) -> str:
    """A value of a `key=value` text line: strings with anything but a plain word in them (a
    prompt, an abort message) are JSON-quoted, so one request stays one line."""
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, str) and PLAIN.fullmatch(value):
        return value
    return _json(value)  # ints, true / false / null, quoted strings, objects

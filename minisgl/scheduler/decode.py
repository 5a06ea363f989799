"""The running set: every admitted request whose prompt is fully prefilled."""

from __future__ import annotations

from minisgl.core import Req


class DecodeManager:
    def __init__(self) -> None:
        self.running: dict[Req, None] = {}  # insertion-ordered set

    def add(self, req: Req) -> None:
        self.running[req] = None

    def remove(self, req: Req) -> None:
        self.running.pop(req, None)

    def __len__(self) -> int:
        return len(self.running)

    def schedule(self) -> list[Req]:
        # NOTE: a request whose last token is already in flight has remain_len 0: it waits for
        # that token to be processed and is not decoded again.
        return [r for r in self.running if r.remain_len > 0]

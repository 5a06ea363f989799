"""The Responses API's in-memory store: each stored response with the conversation it ends
(for `previous_response_id`) and its input items, at most `capacity` of them, the oldest
dropped first."""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from minisgl.errors import InvalidRequest


class UnknownResponse(InvalidRequest):
    """A response id this server does not hold (HTTP 404)."""


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, the response's output included
    input_items: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._stored[stored.response["id"]] = stored
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        stored = self._stored.get(response_id)
        if stored is None:
            raise UnknownResponse(f"Response with id '{response_id}' not found.")
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._stored[response_id]

    def conversation(self, previous_id: Any) -> list[dict[str, Any]]:
        """The messages a `previous_response_id` continues (a copy the caller may extend)."""
        if not isinstance(previous_id, str):
            raise InvalidRequest("previous_response_id must be a string")
        try:
            return copy.deepcopy(self.get(previous_id).conversation)
        except UnknownResponse:
            raise UnknownResponse(f"Previous response with id '{previous_id}' not found."
                                  + ("" if self.capacity > 0 else
                                     " (this server stores no responses: "
                                     "--max-stored-responses 0)")) from None

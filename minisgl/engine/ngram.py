"""N-gram drafts (`--speculative-algorithm NGRAM`): a request's own
tokens (prompt and output) predict its next ones. The last n tokens, for n from the longest
window down, are looked up among the earlier n-grams of the request; the tokens that followed
the most recent earlier match are the draft.

The index is built as tokens arrive, O(windows) dictionary writes per token, so a lookup is
O(windows) whatever the length: nothing in a step's profile. An n-gram is entered only once a
token follows it, so the current suffix never matches itself.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams of `min_window`..`max_window` tokens, each mapped to the position
    of the token that followed its latest occurrence."""

    def __init__(self, min_window: int = 1, max_window: int = 4) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram windows need 1 <= min ({min_window}) <= max "
                             f"({max_window})")
        self.min_window, self.max_window = min_window, max_window
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> next token's position

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt, then each step's accepted ones)."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are now followed by `token`
            for n in range(self.min_window, min(self.max_window, end) + 1):
                self.follows[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix seen before (none if none was)."""
        return self.draft_with_match(k)[0]

    def draft_with_match(self, k: int) -> tuple[list[int], int]:
        """draft(k), and the length of the suffix it matched on (0: none)."""
        end = len(self.tokens)
        for n in range(min(self.max_window, end), self.min_window - 1, -1):
            start = self.follows.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + k], n
        return [], 0

    def truncate(self, length: int) -> None:
        """Forget the tokens from `length` on (a retracted request re-prefills them)."""
        if length < len(self.tokens):
            kept = self.tokens[:length]
            self.tokens, self.follows = [], {}
            self.extend(kept)

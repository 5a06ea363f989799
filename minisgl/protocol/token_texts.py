"""The text and raw bytes of single tokens, for logprob entries."""

from __future__ import annotations

from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """The text and the raw bytes of single tokens (logprob entries), cached by id. A token
    that holds part of a UTF-8 character decodes to U+FFFD; its bytes are still exact for
    byte-level BPE and byte-fallback vocabularies."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.hf = tokenizer.hf if tokenizer is not None else None
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._alphabet: dict[str, int] | None = None
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        if type(decoder).__name__ == "ByteLevel":
            self._alphabet = _byte_level_alphabet()

    def _lookup(self, ids: list[int]) -> list[tuple[str, bytes]]:
        missing = list(dict.fromkeys(t for t in ids if t not in self._cache))
        if missing:
            if self.hf is None:
                for t in missing:
                    self._cache[t] = ("", b"")
            else:
                texts = self.hf.batch_decode([[t] for t in missing], skip_special_tokens=False)
                pieces = self.hf.convert_ids_to_tokens(missing)
                for t, text, piece in zip(missing, texts, pieces):
                    self._cache[t] = (text, self._bytes(text, piece))
        return [self._cache[t] for t in ids]

    def _bytes(self, text: str, piece: str | None) -> bytes:
        if piece and self._alphabet is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if piece and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])  # a byte-fallback token
            except ValueError:
                pass
        return text.encode()

    def texts(self, ids: list[int]) -> list[str]:
        return [text for text, _ in self._lookup(ids)]

    def text_and_bytes(self, ids: list[int]) -> list[tuple[str, bytes]]:
        return self._lookup(ids)

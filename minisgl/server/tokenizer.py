"""The tokenizer side: HF fast tokenizer, with long inputs encoded off the event loop thread."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from minisgl.core import InvalidRequest

OFF_LOOP_CHARS = 4096  # inputs longer than this are encoded in a worker thread
# NOTE: the tokenizer's own thread pool would spin next to the engine's threads on every
# batched detokenization step; long inputs already leave the loop thread instead.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer | None:
        """None when the folder has no tokenizer (e.g. a dummy-weights config)."""
        path = Path(path)
        if not any((path / name).exists() for name in
                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        from transformers import AutoTokenizer
        return cls(AutoTokenizer.from_pretrained(str(path)))

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=True)["input_ids"]

    async def encode(self, texts: list[str]) -> list[list[int]]:
        if sum(len(t) for t in texts) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self._encode, texts)
        return self._encode(texts)

    def chat_prompt(self, messages: Any) -> str:
        """The chat template applied as text; its special tokens are parsed when encoded."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
        if getattr(self.hf, "chat_template", None) is None:
            raise InvalidRequest("this model's tokenizer has no chat template")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        except Exception as exc:  # the template rejects a message shape
            raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc

    async def encode_chat(self, messages: Any) -> list[int]:
        text = self.chat_prompt(messages)
        # NOTE: the template already holds any BOS text; do not add special tokens again.
        if len(text) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(lambda: self.hf(text, add_special_tokens=False)["input_ids"])
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

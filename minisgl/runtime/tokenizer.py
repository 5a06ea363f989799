"""The tokenizer side: HF fast tokenizer, with long inputs encoded off the event loop thread."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from minisgl.errors import InvalidRequest

OFF_LOOP_CHARS = 4096  # inputs longer than this are encoded in a worker thread

# NOTE: a normalizer (NFC, NFKC) may merge a few characters into one before tokenization.
NORMALIZER_SLACK = 4


class Tokenizer:
    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.max_chars_per_token = _max_chars_per_token(hf)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer | None:
        """None when the folder has no tokenizer (e.g. a dummy-weights config)."""
        path = Path(path)
        if not any((path / name).exists() for name in
                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return None
        return cls(_load_hf(path))

    def _encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"]

    def check_length(self, chars: int, context_len: int) -> None:
        """Refuse, before tokenizing it, a text that cannot fit in `context_len` tokens."""
        most = context_len * self.max_chars_per_token
        if chars > most:
            raise InvalidRequest(
                f"The input ({chars} characters) is longer than the model's context length "
                f"({context_len} tokens, at most {self.max_chars_per_token} characters each)")

    async def encode(self, texts: list[str], context_len: int,
                     add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            self.check_length(len(text), context_len)
        if sum(len(t) for t in texts) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(self._encode, texts, add_special_tokens)
        return self._encode(texts, add_special_tokens)

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def set_chat_template(self, template: str) -> None:
        """--chat-template: a file's contents or an inline Jinja template."""
        self.hf.chat_template = template

    def chat_prompt(self, messages: Any, template_kwargs: dict[str, Any] | None = None) -> str:
        """The chat template applied as text, ending in the assistant's turn unless
        `template_kwargs` sets add_generation_prompt false; its special tokens are parsed when
        encoded. `template_kwargs` become template variables."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
        if getattr(self.hf, "chat_template", None) is None:
            raise InvalidRequest("this model's tokenizer has no chat template")
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as exc:  # the template rejects a message shape
            folded = fold_system(messages)
            if folded is not None:
                try:
                    return self.hf.apply_chat_template(folded, tokenize=False, **kwargs)
                except Exception:
                    pass
            raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc

    async def encode_chat(self, messages: Any, context_len: int,
                          template_kwargs: dict[str, Any] | None = None,
                          prefix: str = "") -> list[int]:
        """The template's ids, then those of `prefix`: the start of the assistant's answer
        that the model continues (assistant prefill)."""
        self.check_length(sum(len(m.get("content") or "") for m in messages
                              if isinstance(m, dict) and isinstance(m.get("content"), str))
                          + len(prefix), context_len)
        text = self.chat_prompt(messages, template_kwargs)
        self.check_length(len(text) + len(prefix), context_len)

        def encode() -> list[int]:
            # NOTE: the template already holds any BOS text; do not add special tokens again.
            ids = self.hf(text, add_special_tokens=False)["input_ids"]
            if prefix:
                ids += self.hf(prefix, add_special_tokens=False)["input_ids"]
            return ids

        if len(text) + len(prefix) > OFF_LOOP_CHARS:
            return await asyncio.to_thread(encode)
        return encode()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with a leading system message folded into the first user turn (its text,
    a blank line, then the user's), as Gemma 3's template does itself, for templates without a
    system role (Gemma 2's raises on one); None when there is nothing to fold."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return None
    system, user = messages[0].get("content"), messages[1].get("content")
    if not isinstance(system, str):
        return None
    if isinstance(user, str):
        content: Any = f"{system}\n\n{user}"
    elif isinstance(user, list):
        content = [{"type": "text", "text": f"{system}\n\n"}, *user]
    else:
        return None
    return [{**messages[1], "content": content}, *messages[2:]]


def _max_chars_per_token(hf: Any) -> int:
    """An upper bound on the characters of text one token stands for: the longest vocabulary
    piece (byte-level pieces hold one character per byte, and a character is at least one
    byte), times NORMALIZER_SLACK when the tokenizer normalizes its input."""
    longest = max(map(len, hf.get_vocab()), default=1)
    normalizer = getattr(getattr(hf, "backend_tokenizer", None), "normalizer", None)
    return longest * (NORMALIZER_SLACK if normalizer is not None else 1)


def _load_hf(path: Path) -> Any:
    """AutoTokenizer's tokenizer for the folder. NOTE: for a folder that declares transformers
    5's generic fast tokenizer (every GGUF minisgl converts) AutoTokenizer imports the model's
    config class only to pick that same class, seconds of imports at every start; its rule for
    such a folder is applied here without them, and anything else goes through it."""
    from transformers import AutoTokenizer
    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import (
            MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, TOKENIZER_MAPPING_NAMES)
    except ImportError:  # transformers 4
        return AutoTokenizer.from_pretrained(str(path))
    declared = _read_json(path / "tokenizer_config.json")
    model_type = _read_json(path / "config.json").get("model_type")
    registered = (TOKENIZER_MAPPING_NAMES.get(model_type) or "").removesuffix("Fast")
    if (declared.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in declared
            and registered != "MistralCommonBackend"
            and model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS):
        return TokenizersBackend.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

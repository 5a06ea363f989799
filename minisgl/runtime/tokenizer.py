"""Text in and text out. In: the HF fast tokenizer, with long inputs encoded off the event loop
thread, and the chat template. Out: incremental, UTF-8 safe detokenization with stop strings
and stop regexes, batched per scheduler step.

Each request decodes a sliding window: `surr` tokens already shown plus the new ones. Text is
emitted only when the window's decoding does not end in U+FFFD (a multi-byte character split
across tokens), so a character is never sent half or twice. Stop strings are searched in the
cumulative text; while a request runs, the last (longest stop - 1) characters are held back
so that the text a client sees only ever grows.

Stop regexes (SGLang's `stop_regex`) are searched in the same text each step, from the first
position where a new match can still start (`stop_regex.StopRegex.reach`), with a timeout:
this runs on the server's one event loop. A match is kept in the text, which ends at the
match's end (SGLang keeps it too). As in SGLang, a pattern is searched in the text generated so
far, so `\\bthe\\b` matches a "the" at the end of it even if the next token would have made it
"there". Of a stop string and a regex match, the one that ends first in the text wins.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.stop_regex import StopRegex, compile_stop_regex


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


CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output, for leading spaces/merges
# Time all of one request's stop regexes may take in one step; past it the request is aborted.
STOP_REGEX_TIMEOUT_S = 0.05


@dataclass
class DecodeState:
    """One request's detokenization. Offsets index its tokens: `context`, then `output_ids`."""

    params: SamplingParams
    context: list[int]  # the prompt's last tokens, decoded in front of the output
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all the text decoded so far
    # what ended the request: {"type": "stop", "matched": the stop string or regex}, or an
    # abort (a stop regex that took too long)
    finish_reason: dict[str, Any] | None = None
    visible_len: int = 0  # text[:visible_len] may be shown to the client
    output_ids: list[int] = field(default_factory=list)
    regexes: list[StopRegex] = field(default_factory=list)
    regex_searched: int = 0  # length of the text the regexes were last searched in

    @classmethod
    def start(cls, prompt_ids: list[int], params: SamplingParams) -> DecodeState:
        context = prompt_ids[-CONTEXT_TOKENS:]
        return cls(params=params, context=context, surr_offset=0, read_offset=len(context),
                   regexes=[compile_stop_regex(p) for p in params.stop_regexes])

    @property
    def num_tokens(self) -> int:
        return len(self.context) + len(self.output_ids)

    def tokens(self, start: int, end: int | None = None) -> list[int]:
        """Tokens [start, end) of context + output_ids."""
        skip = len(self.context)
        if start >= skip:
            return self.output_ids[start - skip: None if end is None else end - skip]
        return (self.context + self.output_ids)[start:end]

    @property
    def visible_text(self) -> str:
        return self.text[: self.visible_len]


def rust_decode(hf: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own decode, where the HF tokenizer's gives the same text (a fast
    tokenizer, decode not overridden, no clean-up of spaces), without transformers' Python
    around it, which every streamed token would pay. None otherwise."""
    backend = getattr(hf, "_tokenizer", None)
    kind = type(hf)
    if (backend is None or getattr(hf, "clean_up_tokenization_spaces", True)
            or kind._decode.__qualname__ not in ("TokenizersBackend._decode",
                                                 "PreTrainedTokenizerFast._decode")
            or kind.batch_decode.__qualname__ != "PreTrainedTokenizerBase.batch_decode"
            or kind.decode.__qualname__ != "PreTrainedTokenizerBase.decode"):
        return None
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._rust_decode = rust_decode(tokenizer)

    def _batch_decode(self, sequences: list[list[int]], **kwargs: Any) -> list[str]:
        if self._rust_decode is None:
            return self.tokenizer.batch_decode(sequences, **kwargs)
        skip = kwargs["skip_special_tokens"]  # NOTE: a fast tokenizer ignores the spacing flag
        return [self._rust_decode(ids, skip_special_tokens=skip) for ids in sequences]

    def step(self, updates: list[tuple[DecodeState, int | None, bool]]) -> list[DecodeState]:
        """Apply one step's new token (or None) to each state; `finished` (truthy) flushes
        held-back text, and "stop" says the token is the stop token that ends the request:
        its text is left out of the text, as SGLang trims it, unless no_stop_trim (with
        skip_special_tokens false, an end-of-turn token would otherwise show). Returns the
        states that a stop string or regex finished in this step."""
        pending: dict[int, DecodeState] = {}
        trimmed: list[tuple[DecodeState, int]] = []
        for state, token, finished in updates:
            if token is not None and state.finish_reason is None:
                if finished == "stop" and not state.params.no_stop_trim:
                    trimmed.append((state, token))
                    continue
                state.output_ids.append(token)
                pending[id(state)] = state  # NOTE: once, though coalesced steps repeat it
        self._decode(list(pending.values()))
        for state, token in trimmed:
            state.output_ids.append(token)
            state.surr_offset = state.read_offset = state.num_tokens
        stopped = []
        for state, _, finished in updates:
            if state.finish_reason is None and self._match_stop(state):
                stopped.append(state)
            elif state.finish_reason is None:
                hold = 0 if finished else max((len(s) for s in state.params.stop_strings),
                                              default=1) - 1
                state.visible_len = max(state.visible_len, len(state.text) - hold)
        return stopped

    def _decode(self, states: list[DecodeState]) -> None:
        if not states:
            return
        for skip in (True, False):
            group = [s for s in states if s.params.skip_special_tokens is skip]
            if not group:
                continue
            kwargs = {"skip_special_tokens": skip,
                      "spaces_between_special_tokens": group[0].params.spaces_between_special_tokens}
            surr = self._batch_decode([s.tokens(s.surr_offset, s.read_offset) for s in group],
                                      **kwargs)
            full = self._batch_decode([s.tokens(s.surr_offset) for s in group], **kwargs)
            for state, before, now in zip(group, surr, full):
                if now.endswith("\ufffd") or len(now) <= len(before):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                state.text += now[len(before):]
                state.surr_offset, state.read_offset = state.read_offset, state.num_tokens

    @staticmethod
    def _match_stop(state: DecodeState) -> bool:
        """Finds the first stop (by where it ends in the text) and cuts the text there."""
        best: tuple[int, int, str] | None = None  # (end, where the text ends, what matched)
        stops = state.params.stop_strings
        if stops:
            window_start = max(0, state.visible_len - max(len(s) for s in stops))
            for stop in stops:
                at = state.text.find(stop, window_start)
                if at >= 0:
                    end = at + len(stop)
                    cut = end if state.params.no_stop_trim else at
                    if best is None or (end, cut) < best[:2]:
                        best = (end, cut, stop)
        if state.regexes and len(state.text) > state.regex_searched:
            searched, state.regex_searched = state.regex_searched, len(state.text)
            deadline = time.perf_counter() + STOP_REGEX_TIMEOUT_S
            for stop in state.regexes:
                pos = 0 if stop.reach is None else max(0, searched - stop.reach)
                try:  # NOTE: search(text, pos), not text[pos:]: `^` and lookbehinds keep
                    # their meaning
                    match = stop.compiled.search(
                        state.text, pos, timeout=max(deadline - time.perf_counter(), 1e-3))
                except TimeoutError:
                    state.visible_len = len(state.text)
                    state.finish_reason = {
                        "type": "abort", "message": (
                            f"stop_regex {stop.pattern!r} took too long to search (over "
                            f"{STOP_REGEX_TIMEOUT_S * 1000:.0f} ms in one step); the request "
                            "was stopped")}
                    return True
                if match is not None and (best is None or match.end() < best[0]):
                    best = (match.end(), match.end(), stop.pattern)
        if best is None:
            return False
        _, cut, matched = best
        end = max(cut, state.visible_len)  # NOTE: the visible text only grows
        state.text = state.text[:end]
        state.visible_len = end
        state.finish_reason = {"type": "stop", "matched": matched}
        return True

"""Plain data shared by every layer: sampling parameters, requests and batches. No I/O here."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from minisgl.errors import InvalidRequest


# Temperatures and top_p below this sample greedily (SGLang's epsilon): dividing logits by a
# denormal temperature overflows, and a top_p that small keeps only the top token anyway.
SAMPLING_EPS = 1e-6

# SGLang sampling parameters that change nothing of the output (stream_interval only changes
# how the stream is cut; custom_params feed a custom logit processor, which is refused).
INERT_SAMPLING_FIELDS = frozenset({"stream_interval", "custom_params"})
# SGLang sampling parameters minisgl does not act on: accepted only when they ask for nothing.
UNSUPPORTED_SAMPLING_FIELDS = frozenset({"beam_width", "watermark",
                                         "choice"})
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")  # at most one per request
INTERNAL_SAMPLING_FIELDS = frozenset({"grammar_after"})  # set by minisgl, never by a request


def asks_nothing(value: Any, nested: bool = False) -> bool:
    """An optional field left at its default: null, false, empty, 0 (not inside a list: a
    token id or an embedding), or a list of such defaults (one per prompt of a batch)."""
    if isinstance(value, list):
        return all(asks_nothing(v, nested=True) for v in value)
    if value is None or value is False or value == "" or value == {}:
        return True
    return not nested and type(value) is int and value == 0


@dataclass
class SamplingParams:
    """SGLang's `sampling_params`, same names and defaults. `max_new_tokens: None` asks for as
    many tokens as the context and the KV pool leave (resolved when the request is queued)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # see stop_regex.compile_stop_regex
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id (JSON: its string) -> added logit
    json_schema: str | None = None  # a JSON schema, as a string (a JSON object is dumped)
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # xgrammar's (or SGLang's older) structural tag, as JSON
    # NOTE: set by the chat endpoint, never by a client: the grammar applies to the output
    # after this text (a reasoning model's `</think>`); anything goes before it
    grammar_after: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SamplingParams:
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise InvalidRequest("sampling_params must be a JSON object")
        for name in sorted(UNSUPPORTED_SAMPLING_FIELDS & set(values)):
            if not asks_nothing(values[name]) and not (name == "beam_width"
                                                       and values[name] == 1):
                raise InvalidRequest(f"sampling parameter {name} is not supported by minisgl")
        known = set(cls.__dataclass_fields__) - INTERNAL_SAMPLING_FIELDS
        unknown = sorted(set(values) - known - INERT_SAMPLING_FIELDS
                         - UNSUPPORTED_SAMPLING_FIELDS)
        if unknown:  # NOTE: as SGLang: a misspelt sampling parameter must not pass unseen
            raise InvalidRequest(f"unknown sampling parameter(s): {', '.join(unknown)}")
        params = cls(**{k: v for k, v in values.items() if k in known and v is not None})
        if "max_new_tokens" in values and values["max_new_tokens"] is None:
            params.max_new_tokens = None
        params.validate()
        return params

    def validate(self) -> None:
        def check_type(name: str, kinds: tuple[type, ...]) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in kinds:
                raise InvalidRequest(f"{name} must be a number, got {value!r}")
            if not isinstance(value, kinds):
                raise InvalidRequest(f"{name} has the wrong type: {value!r}")

        if self.max_new_tokens is not None:
            check_type("max_new_tokens", (int,))
        for name in ("top_k", "min_new_tokens", "n"):
            check_type(name, (int,))
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            check_type(name, (int, float))
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequest(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):
            check_type(name, (bool,))
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequest(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        most = self.max_new_tokens if self.max_new_tokens is not None else self.min_new_tokens
        if not 0 <= self.min_new_tokens <= most:
            raise InvalidRequest(
                f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.n < 1:
            raise InvalidRequest(f"n must be >= 1, got {self.n}")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise InvalidRequest("stop must be a non-empty string or a list of them")
        if self.stop_regex is not None:  # compiled in scheduler.intake, after its size limits
            patterns = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
            if not isinstance(patterns, list) or not all(isinstance(p, str) and p
                                                         for p in patterns):
                raise InvalidRequest("stop_regex must be a non-empty string (a regular "
                                     "expression) or a list of them")
        if self.stop_token_ids is not None and not (
            isinstance(self.stop_token_ids, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids)
        ):
            raise InvalidRequest("stop_token_ids must be a list of integers")
        if self.sampling_seed is not None and (
            not isinstance(self.sampling_seed, int) or isinstance(self.sampling_seed, bool)
        ):
            raise InvalidRequest("sampling_seed must be an integer")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        for name in ("json_schema", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, json.dumps(getattr(self, name)))
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) not in (None, "")]
        if len(given) > 1:
            raise InvalidRequest(f"give at most one of {', '.join(GRAMMAR_FIELDS)}, got "
                                 f"{' and '.join(given)}")
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"{name} must be a string")

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar the output must follow, or None."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) not in (None, ""):
                return name, getattr(self, name)
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        """The stop_regex patterns ([] is none: SGLang's frontend sends it by default)."""
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_p < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0
                or self.repetition_penalty != 1)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token


def _check_logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias} from JSON's {"id": bias}; raises InvalidRequest."""
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to numbers")
    checked = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or isinstance(key, bool):
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}")
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequest(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {key}")
        checked[token] = float(value)
    return checked


@dataclass(slots=True)
class LogprobState:
    """What a request asked of logprobs, and its prompt's logprobs while they are gathered."""

    num: int  # 0: the sampled token's; k: the top k alternatives too
    start_len: int = -1  # input logprobs from this prompt position (-1: none)
    # NOTE: a prompt's scored positions may span several prefill chunks; their logprobs are
    # gathered here and handed over once, with the first output
    input_logprobs: list[float] = field(default_factory=list)  # of host_ids[start_len + 1 + i]
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)


@dataclass(eq=False)
class ImageInput:
    """One image as its model's processor made it: `tokens` placeholder positions of the
    prompt take the encoder's output for `pixels` (one embedding each)."""

    key: int  # a 128-bit hash of the processed pixels: the placeholders' prefix-cache key
    tokens: int
    pixels: torch.Tensor  # the processor's patches, as the model's encoder takes them
    grid: tuple[int, int, int]  # the model's layout of it (Qwen-VL: t, h, w in patches)


@dataclass
class PromptImages:
    """A prompt's images, and where multimodal RoPE puts its tokens (Qwen-VL: an image's
    tokens turn by their row and column, not their index)."""

    images: list[ImageInput]
    offsets: list[int]  # each image's first placeholder position in the prompt
    rope: torch.Tensor | None = None  # [3, prompt_len] int64: each prompt token's positions
    rope_delta: int = 0  # a token past the prompt turns at its index plus this
    # an image's tokens see each other both ways (Gemma 3): one forward takes all of an image's
    # tokens it has not cached (scheduler.prefill.chunk_count)
    whole: bool = False

    def overlapping(self, start: int, end: int) -> list[tuple[ImageInput, int, int, int]]:
        """(image, its first placeholder in the span, how many, where they start in the span)
        of each image with placeholders in positions [start, end)."""
        found = []
        for image, offset in zip(self.images, self.offsets):
            first, last = max(start, offset), min(end, offset + image.tokens)
            if first < last:
                found.append((image, first - offset, last - first, first - start))
        return found

    def chunk_end(self, start: int, end: int) -> int:
        """`end`, or where a chunk [start, end) that cuts an image ends instead: before the
        image, or at its end when the chunk starts in it."""
        for image, offset in zip(self.images, self.offsets):
            if offset < end < offset + image.tokens:
                return offset if offset > start else offset + image.tokens
        return end

    def rope_positions(self, start: int, count: int) -> torch.Tensor:
        """[3, count] positions of tokens [start, start + count)."""
        index = torch.arange(start, start + count)
        out = (index + self.rope_delta).expand(3, count).clone()
        if self.rope is not None:
            inside = max(0, min(start + count, self.rope.shape[1]) - start)
            out[:, :inside] = self.rope[:, start:start + inside]
        return out


IMAGE_KEY_SHIFT = 128  # an image placeholder's cache key: past its 128-bit content hash


def cache_id_kind(cache_id: int) -> int:
    """The kind `Req.cache_ids` gave a key (lora_uid * 2 + long_rope)."""
    image = cache_id >> IMAGE_KEY_SHIFT
    return image - 1 if image else cache_id >> 32


class Req:
    """One sequence being scheduled.

    `host_ids` is append-only: the prompt (its first `prompt_len` tokens), then every processed
    output token. Positions [0, kv_len) have K/V computed (or being computed by a launched
    batch), of which the first `shared_len` are pages the prefix cache holds for it under
    `cache_handle` (lent at admission, or its own prefilled pages handed over: see
    scheduler.prefill); tokens [0, device_len) are known on the device (`token_pool`).

    The first twelve slots are what every request has; each one after them is one feature's
    state, left at None (or 0) by a request that does not use the feature.
    """

    __slots__ = ("uid", "rid", "host_ids", "prompt_len", "params", "stop_ids", "table_idx",
                 "kv_len", "device_len", "tail_loc", "cache_handle", "finish_reason",
                 "cached_tokens", "priority", "generator", "matcher", "logprobs", "spec",
                 "lora_uid", "embed", "images", "tier_tokens")

    def __init__(self, uid: int, rid: str, prompt_ids: list[int], params: SamplingParams,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        assert params.max_new_tokens is not None, "resolved before a request is queued"
        self.uid, self.rid = uid, rid
        self.host_ids = list(prompt_ids)
        self.prompt_len = len(self.host_ids)
        self.params = params
        self.stop_ids = stop_ids  # sampled ids that finish it (EOS unless ignored)
        self.table_idx = -1
        self.kv_len = self.device_len = 0
        self.tail_loc = -1  # KV location of position kv_len - 1 (for partly filled pages)
        self.cache_handle: Any = None  # locks the shared prefix in the prefix cache
        self.finish_reason: dict[str, Any] | None = None
        # ---- one slot per feature
        self.cached_tokens = 0  # prefix cache: prompt tokens it served at the first admission
        # hierarchical cache: of those, the tokens each lower tier served (by tier name)
        self.tier_tokens: dict[str, int] | None = None
        self.priority = 0  # priority scheduling: higher first (scheduler.prefill.WaitingOrder)
        self.generator: torch.Generator | None = None  # sampling_seed: its own generator
        self.matcher: Any = None  # a grammar's state (grammar.backend.Matcher)
        self.logprobs: LogprobState | None = None
        # NOTE: a speculating request's kv_len and device_len are upper bounds while a verify
        # step is in flight (see scheduler.speculation): KV slots are reserved for its drafts
        self.spec: Any = None  # speculative decoding: its tally (scheduler.speculation)
        self.lora_uid = 0  # its LoRA adapter (scheduler.lora), 0: the base model
        self.embed = False  # --is-embedding: its last prompt token's final hidden state
        self.images: PromptImages | None = None  # a multimodal prompt's images

    def __repr__(self) -> str:
        return (f"Req(uid={self.uid}, rid={self.rid!r}, tokens={len(self.host_ids)}, "
                f"kv_len={self.kv_len}, finish_reason={self.finish_reason})")

    def cache_ids(self, end: int | None = None, long_rope: bool = False) -> list[int]:
        """host_ids[:end] as the prefix cache keys them: offset by the KV's kind (its LoRA
        adapter; `long_rope`: a LongRoPE prompt rotated by the long factors throughout), an
        image's placeholders by the image, so KV computed one way never serves a request that
        computes it another."""
        ids = self.host_ids[:end]
        kind = self.lora_uid * 2 + long_rope
        if kind:
            offset = kind << 32
            ids = [t + offset for t in ids]
        if self.images is not None:  # an image's placeholders are keyed by its content
            ids = list(ids)
            for image, offset in zip(self.images.images, self.images.offsets):
                key = ((kind + 1) << IMAGE_KEY_SHIFT) + image.key
                span = len(ids[offset:offset + image.tokens])  # `end` may cut the image
                ids[offset:offset + span] = [key] * span
        return ids

    @property
    def prompt_ids(self) -> list[int]:
        return self.host_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.host_ids[self.prompt_len:]

    @property
    def num_outputs(self) -> int:
        return len(self.host_ids) - self.prompt_len

    @property
    def max_device_len(self) -> int:
        return self.prompt_len + self.params.max_new_tokens

    @property
    def shared_len(self) -> int:
        return 0 if self.cache_handle is None else self.cache_handle.length

    @property
    def scored_positions(self) -> range:
        """Prompt positions whose logits give an input logprob: position p scores
        host_ids[p + 1]. (SGLang's layout: the token at logprob_start_len itself gets None,
        and the last prompt position's logits are the first output's.)"""
        if self.logprobs is None or self.logprobs.start_len < 0:
            return range(0)
        return range(self.logprobs.start_len, self.prompt_len - 1)

    @property
    def input_logprob_positions(self) -> range:
        """The scored positions still to deliver: none once an output was produced (they
        went with it)."""
        return range(0) if self.num_outputs else self.scored_positions

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens 0 with prompt tokens to score or an embedding to take: one prefill,
        then finished; nothing is sampled into its row of the token pool."""
        return self.params.max_new_tokens == 0 and (self.embed or bool(self.scored_positions))

    @property
    def cacheable_len(self) -> int:
        """Tokens of host_ids whose KV is computed, at most (pages past them are reserved or
        wait for a step still in flight)."""
        if self.spec is not None:
            return min(self.kv_len, len(self.host_ids) - 1)
        return min(self.kv_len, len(self.host_ids))

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


# A mixed batch (--enable-mixed-chunk) is a prefill whose last `decode_rows` rows are running
# requests decoding one token each.
Phase = Literal["prefill", "decode", "mixed"]


@dataclass
class Batch:
    """The device's view of one forward: per row its page-table row and lengths, per token its
    position and KV location. Rows past `size` are padding (CUDA graphs: the dummy row)."""

    phase: Phase
    size: int  # real rows
    table_rows: list[int]  # per row, padding included
    cached_lens: list[int]  # per row, before this batch
    seq_lens: list[int]  # per row, after this batch
    extend_lens: list[int]  # per row: new tokens
    input_positions: torch.Tensor | None = None  # [num_tokens]
    out_loc: torch.Tensor | None = None  # [num_tokens] KV slot each new token writes to
    attn_metadata: Any = None
    decode_rows: int = 0  # mixed: the trailing rows that decode
    # --enable-lora: per row the adapter slot it uses (-1: none); None when no row uses one
    lora_slots: list[int] | None = None
    # [num_tokens] each token's row of the RoPE table, where some row is not the token's
    # position (layers.rotary.LongRopeSwitch; a multimodal prompt's tokens past its images),
    # or [3, num_tokens] a multimodal RoPE's (PromptImages); attention reads input_positions
    rope_positions: torch.Tensor | None = None
    # token rows whose input embedding is replaced, and their values (an image's placeholders:
    # its encoder's output); set by the engine when the forward runs
    input_embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    # images whose tokens see each other both ways (Gemma 3): per image in this forward, (its
    # first token row, its table row, its first and end position); the image is whole here
    image_blocks: list[tuple[int, int, int, int]] | None = None
    # a verify step laid out for a CUDA graph: every row forwards this many tokens, its own
    # then filler ones (engine.speculation); 0 otherwise
    row_tokens: int = 0
    # hybrid models' prefix cache (kvcache.state_cache): state-pool rows copied (source,
    # target) before the forward, and per table row the state saved into a snapshot slot
    # (row, tokens of its span run first, slot) during it
    state_loads: list[tuple[int, int]] | None = None
    state_saves: list[tuple[int, int, int]] | None = None

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def padded_size(self) -> int:
        return len(self.table_rows)

    @property
    def graph_width(self) -> int:
        """Tokens each row forwards in a CUDA graph: 1 (decode), a verify step's row_tokens,
        or 0 (no graph takes it)."""
        return 1 if self.is_decode else self.row_tokens


def span_indices(rows: list[int], starts: list[int], counts: list[int], context_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Spans [start, start + count) of table rows, concatenated: their positions, and their
    flat indices into a [rows, context_len] table (the token pool, the page table)."""
    if sum(counts) <= 64:  # NOTE: a decode or verify step's few: lists beat 8 tensor ops
        positions = [start + j for start, count in zip(starts, counts) for j in range(count)]
        rows_of = [row for row, count in zip(rows, counts) for _ in range(count)]
        return torch.tensor(positions, dtype=torch.int64), torch.tensor(
            [row * context_len + p for row, p in zip(rows_of, positions)], dtype=torch.int64)
    counts_t = torch.tensor(counts)
    positions = torch.arange(int(counts_t.sum())) + torch.repeat_interleave(
        torch.tensor(starts) - (counts_t.cumsum(0) - counts_t), counts_t)
    return positions, torch.repeat_interleave(torch.tensor(rows), counts_t) * context_len + (
        positions)

"""Admission checks: everything a request must pass before anything of its batch is queued.

`check_batch` is the one validation that every entry point goes through (the HTTP endpoints,
the offline API and the scheduler itself): a batch with one bad element is refused as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, TypeVar

from minisgl.core import PromptImages, SamplingParams
from minisgl.errors import InvalidRequest, QueueFull
from minisgl.scheduler.memory import pages_spanned
from minisgl.stop_regex import compile_stop_regex


@dataclass
class RequestSpec:
    """One sequence to queue: its prompt ids and what to do with them."""

    input_ids: list[int]
    params: SamplingParams
    rid: str | None = None
    logprob_num: int = -1  # -1: no logprobs; 0: the sampled token's; k: also the top k
    logprob_start_len: int = -1  # first prompt position of the input logprobs (-1: none)
    matcher: Any = None  # params.grammar's matcher (grammar.backend.Matcher), made on submission
    priority: int | None = None  # used with --enable-priority-scheduling
    lora: str | None = None  # a loaded LoRA adapter's name (--enable-lora), None: the base model
    embed: bool = False  # answer the last prompt token's final hidden state (max_new_tokens 0)
    images: PromptImages | None = None  # a multimodal prompt's images, processed


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int
    pool_pages: int
    page_size: int
    max_sequences: int  # prompts x n in one request
    max_stop_strings: int
    max_stop_string_length: int
    max_queued: int | None

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_size


Spec = TypeVar("Spec", bound=RequestSpec)


def expand_samples(specs: list[Spec], max_sequences: int) -> list[list[Spec]]:
    """Each spec becomes `params.n` sequences (group i holds spec i's samples). With n > 1,
    sample j gets rid `{rid}-{j}` and, when seeded, sampling_seed + j (so the samples differ).
    The total is checked before anything is built."""
    total = sum(s.params.n for s in specs)
    if total > max_sequences:
        raise InvalidRequest(
            f"the request asks for {total} sequences (prompts x n); at most {max_sequences} "
            "are allowed in one request (--max-sequences-per-request)")
    groups = []
    for spec in specs:
        n = spec.params.n
        group = []
        for j in range(n):
            params = replace(spec.params, n=1)
            if n > 1 and params.sampling_seed is not None:
                params.sampling_seed += j
            rid = spec.rid if n == 1 or spec.rid is None else f"{spec.rid}-{j}"
            group.append(replace(spec, params=params, rid=rid))
        groups.append(group)
    return groups


def fill_max_new_tokens(spec: Spec, limits: RequestLimits) -> Spec:
    """`max_new_tokens: None` asks for as many tokens as the context and the pool leave."""
    if spec.params.max_new_tokens is not None:
        return spec
    room = max(min(limits.context_len, limits.pool_tokens) - len(spec.input_ids), 0)
    return replace(spec, params=replace(spec.params, max_new_tokens=room))


def check_batch(specs: list[RequestSpec], limits: RequestLimits, rid_taken: Callable[[str], bool],
                waiting: int) -> None:
    """Raises InvalidRequest (naming the batch item) or QueueFull; queues nothing. `waiting`:
    the queue's length, less what the batch may displace (priority scheduling). The number of
    sequences was capped when the batch was built (`expand_samples`)."""
    if not specs:
        raise InvalidRequest("the request holds no prompt")
    rids = [s.rid for s in specs if s.rid is not None]
    if len(set(rids)) != len(rids):
        raise InvalidRequest("rid values must be unique within a request")
    for i, spec in enumerate(specs):
        try:
            check_one(spec, limits, rid_taken)
        except InvalidRequest as exc:
            if len(specs) == 1:
                raise
            raise InvalidRequest(f"batch item {i}: {exc}") from None
    if limits.max_queued is not None and waiting + len(specs) > limits.max_queued:
        raise QueueFull(f"the waiting queue is full ({limits.max_queued} requests); retry later")


def check_context(prompt: int, completion: int, context_len: int) -> None:
    """The prompt and the completion asked for must fit the context. The messages carry
    SGLang's phrases, which its clients and tests match on."""
    if prompt >= context_len:
        raise InvalidRequest(f"The input ({prompt} tokens) is longer than the model's context "
                             f"length ({context_len} tokens).")
    if prompt + completion > context_len:
        too_large = (f"max_completion_tokens is too large: {completion}. This model supports "
                     f"at most {context_len} completion tokens. " if completion > context_len
                     else "")
        raise InvalidRequest(
            f"{too_large}Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {prompt + completion} tokens: "
            f"{prompt} tokens from the input messages and {completion} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.")


def check_one(spec: RequestSpec, limits: RequestLimits, rid_taken: Callable[[str], bool]) -> None:
    ids, params = spec.input_ids, spec.params
    if not ids:
        raise InvalidRequest("the prompt is empty")
    vocab = limits.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise InvalidRequest(f"input_ids must be token ids in [0, {vocab})")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab})")
    for name, stops, what in (("stop", params.stop_strings, "string"),
                              ("stop_regex", params.stop_regexes, "pattern")):
        if len(stops) > limits.max_stop_strings:
            raise InvalidRequest(f"{name} has {len(stops)} {what}s; at most "
                                 f"{limits.max_stop_strings} are allowed (--max-stop-strings)")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_string_length:
            raise InvalidRequest(f"a {name} {what} has {longest} characters; "
                                 f"at most {limits.max_stop_string_length} are allowed "
                                 "(--max-stop-string-length)")
    for pattern in params.stop_regexes:  # NOTE: compiled only once its size is known small
        compile_stop_regex(pattern)
    check_context(len(ids), params.max_new_tokens, limits.context_len)
    total = len(ids) + params.max_new_tokens
    if pages_spanned(0, total, limits.page_size) > limits.pool_pages:
        raise InvalidRequest(
            f"the request needs {total} tokens of KV cache but the pool holds only "
            f"{limits.pool_tokens} (--max-total-tokens)")
    if spec.embed and params.max_new_tokens:
        raise InvalidRequest("an embedding request generates no tokens (max_new_tokens 0)")
    if spec.rid is not None and rid_taken(spec.rid):
        raise InvalidRequest(f"a request with rid {spec.rid!r} is already running")
    if spec.logprob_num >= 0 and spec.logprob_start_len >= len(ids):  # as SGLang refuses it
        raise InvalidRequest(f"logprob_start_len ({spec.logprob_start_len}) must be below the "
                             f"number of prompt tokens ({len(ids)})")
    if params.grammar is not None and spec.matcher is None:
        raise InvalidRequest(f"{params.grammar[0]}: the grammar was not compiled")

"""What one forward takes and gives back."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch
from minisgl.engine.sampler import SamplingArgs

if TYPE_CHECKING:
    from minisgl.engine.hicache import KVMoves
    from minisgl.engine.images import ImageSlice
    from minisgl.engine.tp_message import StepMessage


@dataclass
class InputLogprobRows:
    """Prompt positions scored in a prefill (rank 0): their rows follow the batch's sampling
    rows in `ForwardInput.logit_rows`, in request order."""

    targets: torch.Tensor  # [R] int64 on the device: the prompt token each row predicts
    top_k: int  # also the top k of each row (0: none)
    spans: list[tuple[int, int]]  # (batch row, scored rows), in row order


@dataclass
class InputLogprobs:
    """Host copies: raw log-softmax at each scored row's target, and its top k."""

    values: torch.Tensor  # [R] float32
    top: tuple[torch.Tensor, torch.Tensor] | None  # ([R, k] float32, [R, k] int64)


@dataclass
class GrammarMask:
    """The rows of a batch whose next token must follow a grammar, and the tokens each may
    take: bit t % 32 of word t // 32 of its bitmask row, set = allowed.

    NOTE: in the overlap loop batch N+1 is launched before batch N's tokens are known, and a
    grammar row's mask depends on them. The forward runs; only sampling waits for `ready`,
    which the scheduler completes once batch N's tokens are accepted by the matchers. That
    wait is on the CPU engine thread. On CUDA the scheduler's own thread enqueues the step, so
    there the scheduler settles the batch in flight and fills the mask before launching."""

    row_ids: list[int]  # rows of the batch
    rows: torch.Tensor  # the same, [R] int64 on the device
    bitmask: torch.Tensor  # [R, ceil(vocab / 32)] int32 on the host
    ready: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    @property
    def filled(self) -> bool:
        return self.ready.done()

    def release(self, error: BaseException | None = None) -> None:
        """The bitmask is filled (or, with `error`, never will be): let sampling go on."""
        if self.ready.done():
            return
        if error is None:
            self.ready.set_result(self.bitmask)
        else:
            self.ready.set_exception(error)

    def wait(self) -> torch.Tensor:
        return self.ready.result()


@dataclass
class VerifyRows:
    """A decode step whose layout the engine resolves (engine.speculation): per batch row its
    request, how many drafts it may verify (0: a plain decode row) and the length it may reach
    (drafts never pass it)."""

    uids: list[int]
    max_drafts: list[int]
    max_lens: list[int]
    greedy: list[bool]  # per row: accepted by argmax (else by speculative sampling)
    # per row: the grammar matcher (grammar.backend.Matcher) of a speculating row, which
    # engine.speculation walks through its drafts
    matchers: list[Any] = field(default_factory=list)
    # set by Speculator.resolve (rank 0): tokens each row verifies, and its drafts
    counts: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each row's first token row (logits)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [B, K, V]: a draft model's, for sampled rows


@dataclass
class ForwardInput:
    batch: Batch
    load_indices: torch.Tensor  # flat token_pool indices of the input ids
    write_indices: torch.Tensor  # flat token_pool index for each real row's sampled id
    # which token rows need logits: prefill, each request's last token, then any scored
    # prompt positions (input logprobs)
    logit_rows: torch.Tensor | None
    sample_args: SamplingArgs | None  # rank 0
    message: StepMessage | None = None  # tp > 1: what ranks 1..N-1 run
    logits_only: bool = False  # return the logits instead of sampling
    input_logprobs: InputLogprobRows | None = None  # rank 0
    grammar: GrammarMask | None = None  # rank 0: rows that sample under a grammar
    # a speculating decode step: the engine lays it out when it runs (engine.speculation)
    verify: VerifyRows | None = None
    verify_step: bool = False  # every rank: a verify step (logit rows are its tokens, unscored)
    # --enable-lora: adapters to put into slots before this step, (slot, uid, folder)
    lora_loads: list[tuple[int, int, str]] = field(default_factory=list)
    # rank 0, a prefill: the batch rows (int64 on the device) whose last token's final hidden
    # state is an embedding to return (--is-embedding); None when no row wants one
    embed_rows: torch.Tensor | None = None
    # a step reading image placeholders: their token rows (host, every rank) and, on rank 0,
    # the images they read (engine.images); None otherwise
    image_rows: torch.Tensor | None = None
    images: list[ImageSlice] | None = None
    # --enable-hierarchical-cache: pages copied to and from the lower tiers before the step
    kv_moves: KVMoves | None = None
    # continuous decode steps (engine.decode_steps): a decode step that runs `steps` steps,
    # each row's KV location in each ([B, steps] int64, host), and per row the ids that stop it
    steps: int = 1
    step_locations: torch.Tensor | None = None
    stop_ids: list[frozenset[int]] | None = None

    @property
    def num_scored_rows(self) -> int:
        """Rows after the sampling rows (every rank can count them)."""
        if self.logit_rows is None or self.logits_only or self.verify_step:
            return 0
        return len(self.logit_rows) - self.batch.size


@dataclass
class ForwardOutput:
    """Host tensors. On ranks 1..N-1 every field is None (only rank 0 samples). A verify step
    (`counts` set) gives each row `counts[i]` tokens: token_ids [B, W], logprobs [B, W] and
    top_logprobs [B, W, K]."""

    token_ids: torch.Tensor | None = None  # [batch.size] int32: the sampled ids
    logprobs: torch.Tensor | None = None  # [batch.size] float32, when asked
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, K] f32, [B, K] i32)
    counts: torch.Tensor | None = None  # verify: [B] int64, tokens each row emits
    drafted: torch.Tensor | None = None  # verify: [B] int64, drafts each row verified
    input_logprobs: InputLogprobs | None = None
    logits: torch.Tensor | None = None  # logits_only: [rows, vocab] float32, not sampled
    embeddings: torch.Tensor | None = None  # [len(embed_rows), hidden] float32, L2-normalised


def to_host(x: torch.Tensor | None) -> torch.Tensor | None:
    """An asynchronous copy into pinned memory (CUDA); CPU tensors as they are."""
    if x is None or x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)

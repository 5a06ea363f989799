"""Batched token sampling on the device.

`Sampler.sampling_args` turns a batch's `SamplingParams` into device tensors on the host;
`Sampler.sample` applies penalties, logit_bias and min_new_tokens masking, then either takes
the argmax or samples after temperature / top-k / top-p / min-p, and gathers logprobs of the
raw logits.
Everything is vectorized over the batch and vocabulary; the only Python loop is over requests
with their own seeded generator. Sampling inverts the CDF: one uniform draw per row u, the first
token whose running sum of probabilities exceeds u * total, so every row can bring its own draw
and a step draws one number per row, not one per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from minisgl.core import SAMPLING_EPS, Req
from minisgl.kernels import cpu_kernels

# NOTE: with these bounds no logit can overflow: |logit| <= ~1e2 (bias included), divided by
# at most SAMPLING_EPS twice (repetition penalty, temperature); a float32 temperature of inf
# would turn the -inf of a banned token into NaN.
MAX_TEMPERATURE = 1e30


@dataclass
class PenaltyArgs:
    """Rows with a repetition / frequency / presence penalty and where their history lives."""

    rows: torch.Tensor  # [P] int64, rows of the batch
    table_rows: torch.Tensor  # [P] int64, rows of token_pool
    prompt_lens: torch.Tensor  # [P, 1] int64
    seq_lens: torch.Tensor  # [P, 1] int64
    max_len: int  # columns of token_pool to read
    repetition: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    presence: torch.Tensor  # [P, 1] float32


@dataclass
class SamplingArgs:
    """One batch's sampling parameters; tensors are already on the sampler's device."""

    greedy_only: bool  # every row greedy -> argmax, no noise, no filters
    greedy: torch.Tensor | None = None  # [B] bool, None when greedy_only
    temperatures: torch.Tensor | None = None  # [B, 1] float32, 1.0 on greedy rows
    top_ks: torch.Tensor | None = None  # [B, 1] int64, None unless some row uses top_k
    top_ps: torch.Tensor | None = None  # [B, 1] float32, None unless some row uses top_p
    min_ps: torch.Tensor | None = None  # [B, 1] float32, None unless some row uses min_p
    penalties: PenaltyArgs | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, added)
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)  # sampled rows
    return_logprobs: bool = False
    top_logprobs_num: int = 0  # K, the largest top_logprobs_num asked in the batch

    @property
    def raw_argmax(self) -> bool:
        """Every row takes the argmax of its raw logits: greedy, nothing adjusts them."""
        return (self.greedy_only and self.penalties is None and self.banned is None
                and self.bias is None)


@dataclass
class SampleOutput:
    next_tokens: torch.Tensor  # [B] int32
    logprobs: torch.Tensor | None = None  # [B] float32, raw log-softmax at the chosen token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, K] f32, [B, K] i32)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_token_ids: list[int],
                 seed: int | None = None) -> None:
        """`seed`: of the generator every row without its own (no sampling_seed) draws from,
        so the same requests in the same batches sample the same tokens; None: a random one."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=self.device)  # for unseeded rows
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % 2**64)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype), self.device)

    def sampling_args(self, reqs: list[Req], prompt_lens: list[int], output_counts: list[int],
                      table_rows: list[int], seq_lens: list[int],
                      logprob_nums: list[int] | None = None) -> SamplingArgs:
        params = [r.params for r in reqs]
        greedy = [p.is_greedy for p in params]
        args = SamplingArgs(greedy_only=all(greedy))
        vocab = self.vocab_size

        if not args.greedy_only:
            args.greedy = self._tensor(greedy, torch.bool)
            args.temperatures = self._tensor(
                [[1.0 if g else min(float(p.temperature), MAX_TEMPERATURE)]
                 for p, g in zip(params, greedy)], torch.float32)
            top_ks = [vocab if g or p.top_k < 0 else min(p.top_k, vocab)
                      for p, g in zip(params, greedy)]
            top_ps = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
            min_ps = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
            if any(k < vocab for k in top_ks):
                args.top_ks = self._tensor([[k] for k in top_ks], torch.int64)
            if any(p < 1.0 for p in top_ps):
                args.top_ps = self._tensor([[p] for p in top_ps], torch.float32)
            if any(p > 0.0 for p in min_ps):
                args.min_ps = self._tensor([[p] for p in min_ps], torch.float32)
            args.seeded = [(i, r.generator) for i, r in enumerate(reqs)
                           if r.generator is not None and not greedy[i]]

        penalised = [i for i, p in enumerate(params) if p.needs_penalties]
        if penalised:
            args.penalties = PenaltyArgs(
                rows=self._tensor(penalised, torch.int64),
                table_rows=self._tensor([table_rows[i] for i in penalised], torch.int64),
                prompt_lens=self._tensor([[prompt_lens[i]] for i in penalised], torch.int64),
                seq_lens=self._tensor([[seq_lens[i]] for i in penalised], torch.int64),
                max_len=max(seq_lens[i] for i in penalised),
                repetition=self._tensor(
                    [[max(float(params[i].repetition_penalty), SAMPLING_EPS)] for i in penalised],
                    torch.float32),
                frequency=self._tensor(
                    [[float(params[i].frequency_penalty)] for i in penalised], torch.float32),
                presence=self._tensor(
                    [[float(params[i].presence_penalty)] for i in penalised], torch.float32),
            )

        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, p in enumerate(params):
            if output_counts[i] < p.min_new_tokens:
                ids = {t for t in self.eos_token_ids + (p.stop_token_ids or []) if 0 <= t < vocab}
                ban_rows += [i] * len(ids)
                ban_ids += sorted(ids)
        if ban_rows:
            args.banned = (self._tensor(ban_rows, torch.int64), self._tensor(ban_ids, torch.int64))

        biased = [(i, t, b) for i, p in enumerate(params)
                  for t, b in (p.logit_bias or {}).items()]
        if biased:
            rows, ids, values = zip(*biased)
            args.bias = (self._tensor(list(rows), torch.int64),
                         self._tensor(list(ids), torch.int64),
                         self._tensor(list(values), torch.float32))

        if logprob_nums is not None and any(n >= 0 for n in logprob_nums):
            args.return_logprobs = True
            args.top_logprobs_num = min(max(logprob_nums), vocab)
        return args

    def _adjust_logits(self, logits: torch.Tensor, args: SamplingArgs,
                       token_pool: torch.Tensor) -> torch.Tensor:
        """Penalties, logit_bias and min_new_tokens masking, out of place (float32 in, float32
        out)."""
        pen = args.penalties
        if pen is not None:
            num_rows, max_len = pen.rows.numel(), min(pen.max_len, token_pool.shape[1])
            tokens = token_pool[pen.table_rows, :max_len].long()
            pos = torch.arange(max_len, device=logits.device)[None]
            in_context = pos < pen.seq_lens  # prompt + generated
            generated = in_context & (pos >= pen.prompt_lens)
            tokens = tokens.masked_fill(~in_context, 0)  # padding adds 0 weight to token 0
            zeros = logits.new_zeros(num_rows, logits.shape[1])
            seen = zeros.scatter_add(1, tokens, in_context.float()) > 0
            counts = zeros.scatter_add(1, tokens, generated.float())
            rows = logits[pen.rows]
            repeated = torch.where(rows > 0, rows / pen.repetition, rows * pen.repetition)
            rows = torch.where(seen, repeated, rows)
            rows = rows - pen.frequency * counts - pen.presence * (counts > 0).float()
            logits = logits.index_put((pen.rows,), rows)
        if args.bias is not None:
            rows, ids, values = args.bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if args.banned is not None:
            logits = logits.index_put(args.banned, logits.new_full((), float("-inf")))
        return logits

    def _filter(self, probs: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """Zero the probabilities that top-k / top-p / min-p drop (the top token always stays)."""
        if args.top_ks is not None or args.top_ps is not None:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
            if args.top_ks is not None:
                drop |= torch.arange(probs.shape[1], device=probs.device)[None] >= args.top_ks
            if args.top_ps is not None:  # keep while the mass before the token is < top_p
                drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= args.top_ps
            drop[:, 0] = False
            probs = probs.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), 0.0)
        if args.min_ps is not None:
            threshold = args.min_ps * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def target_probs(self, logits: torch.Tensor, args: SamplingArgs, rows: torch.Tensor
                     ) -> torch.Tensor:
        """The sampling distributions [S, W, V] of batch rows `rows` (sampled, no penalties,
        bias or bans: see scheduler.speculation) at each of W positions (`logits` [S, W, V])."""
        width = logits.shape[1]

        def per_position(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[rows].repeat_interleave(width, 0)

        assert args.temperatures is not None
        sub = replace(args, top_ks=per_position(args.top_ks), top_ps=per_position(args.top_ps),
                      min_ps=per_position(args.min_ps))
        flat = logits.reshape(-1, logits.shape[2]) / per_position(args.temperatures)
        return self._filter(torch.softmax(flat, dim=-1), sub).view(logits.shape)

    def _draw(self, probs: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
        """A token per row with probability proportional to `probs` (rows with mass): a uniform
        per row from the shared generator, seeded rows' from their own, against the CDF."""
        uniform = torch.rand(probs.shape[0], 1, generator=self.generator, device=probs.device)
        for row, gen in args.seeded:
            uniform[row] = torch.rand(1, generator=gen, device=gen.device).to(probs.device)
        # NOTE: non-decreasing (probs >= 0; on CPU the sum accumulates in float64, each entry
        # rounded once), so the first entry above the target has a nonzero probability; the
        # target stays below the total even where u * total rounds up to it.
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1)

    def sample(self, logits: torch.Tensor, args: SamplingArgs, token_pool: torch.Tensor,
               grammar: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleOutput:
        """`grammar`: (rows, int32 bitmask [rows, ceil(vocab / 32)]): those rows may only take
        the tokens whose bit is set; their logprobs are those of the masked logits."""
        if grammar is None and args.raw_argmax and not args.return_logprobs:
            # a bfloat16 logit widens exactly: its argmax is the float32 copy's, without the copy
            return SampleOutput(next_tokens=argmax(logits).to(torch.int32))
        raw = logits.float()
        if grammar is not None:
            rows, bitmask = grammar
            raw = raw.index_put((rows,), raw[rows].masked_fill(
                ~unpack_bitmask(bitmask, raw.shape[1]), float("-inf")))
        logits = self._adjust_logits(raw, args, token_pool)
        if args.greedy_only:
            next_tokens = argmax(logits)
        else:
            assert args.greedy is not None and args.temperatures is not None
            probs = self._filter(torch.softmax(logits / args.temperatures, dim=-1), args)
            sampled = self._draw(probs, args)
            next_tokens = torch.where(args.greedy, argmax(logits), sampled)

        out = SampleOutput(next_tokens=next_tokens.to(torch.int32))
        if args.return_logprobs:
            logp = torch.log_softmax(raw, dim=-1)
            out.logprobs = logp.gather(1, next_tokens[:, None]).squeeze(1)
            if args.top_logprobs_num > 0:
                values, ids = logp.topk(args.top_logprobs_num, dim=-1)
                out.top_logprobs = (values, ids.to(torch.int32))
        return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), through the CPU kernel where it runs (torch's CPU argmax is scalar: ~1 ns
    a value, 1-2 ms a step for a decode batch of 64 over a 49k vocabulary)."""
    kernels = (cpu_kernels() if x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                       torch.bfloat16) else None)
    if kernels is None or x.numel() == 0:
        return x.argmax(dim=-1)
    return kernels.argmax_rows(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape[:-1])


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the stream (CUDA: pinned, asynchronous)."""
    if device.type == "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32, bit t % 32 of word t // 32 -> [rows, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()

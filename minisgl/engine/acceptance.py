"""Verifying drafts: one target forward scores a row's last accepted
token and its k drafted ones, k + 1 distributions; the row keeps the longest prefix of drafts
the target accepts, then one token of the target's own. Rows are independent and vectorised;
a row drafts between 0 and k tokens (`draft_lens`, the rest padding).

- Greedy: a draft is accepted while it equals the target's argmax; the extra token is the
  target's argmax after the last accepted draft. The output equals non-speculative greedy
  decoding token for token.
- Sampled (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): draft d_i, drawn
  from the drafter's q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
  rejection the token is drawn from max(0, p_i - q_i) renormalised, and after k acceptances
  from p_k. Each emitted token is then distributed exactly as the target's p. An n-gram draft
  is a point mass (q_i(d_i) = 1): accepted with probability p_i(d_i), else drawn from p_i
  without d_i.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: torch.Tensor, draft_lens: torch.Tensor, target: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k], draft_lens [B], target [B, k + 1] (the target's argmax at each position)
    -> (accepted drafts per row [B], the tokens each row emits [B, k + 1]: its accepted drafts,
    then the target's token; entries past accepted + 1 are padding)."""
    k = drafts.shape[1]
    positions = torch.arange(k, device=drafts.device)
    matches = (drafts == target[:, :k]) & (positions < draft_lens[:, None])
    accepted = torch.cumprod(matches.int(), dim=1).sum(dim=1)
    return accepted, _emitted(drafts, accepted, target.gather(1, accepted[:, None])[:, 0])


def accept_sampled(drafts: torch.Tensor, draft_lens: torch.Tensor, target_probs: torch.Tensor,
                   draft_probs: torch.Tensor | None = None,
                   generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k], draft_lens [B], target_probs [B, k + 1, V] (the target's sampling
    distributions, temperature and filters applied), draft_probs [B, k, V] (the drafter's, from
    which the drafts were drawn; None: point masses) -> as accept_greedy."""
    batch, k = drafts.shape
    device = drafts.device
    rows = torch.arange(batch, device=device)[:, None]
    positions = torch.arange(k, device=device)
    p_draft = target_probs[:, :k].gather(2, drafts[..., None])[..., 0]  # p_i(d_i)
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs.gather(2, drafts[..., None])[..., 0]
        ratio = (p_draft / q_draft.clamp_min(1e-20)).clamp(max=1.0)
    coins = torch.rand(batch, k, device=device, generator=generator)
    keeps = (coins < ratio) & (positions < draft_lens[:, None])
    accepted = torch.cumprod(keeps.int(), dim=1).sum(dim=1)
    # the last token: from the residual at the first rejection, from p_k after all k
    final = target_probs[rows[:, 0], accepted]  # [B, V]
    rejected = accepted < draft_lens
    at = accepted.clamp(max=k - 1) if k else accepted
    if k:
        if draft_probs is None:
            drafted = torch.zeros_like(final).scatter_(1, drafts[rows[:, 0], at][:, None], 1.0)
        else:
            drafted = draft_probs[rows[:, 0], at]
        residual = (final - drafted).clamp_min(0)
        mass = residual.sum(dim=1, keepdim=True)
        # NOTE: a zero residual (p == q) means no rejection could have happened: keep p
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), final)
        final = torch.where(rejected[:, None], residual, final)
    last = torch.multinomial(final, 1, generator=generator)[:, 0]
    return accepted, _emitted(drafts, accepted, last)


def _emitted(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    batch, k = drafts.shape
    out = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    return out.scatter_(1, accepted[:, None], last[:, None].to(out.dtype))

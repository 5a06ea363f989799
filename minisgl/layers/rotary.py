"""Rotary position embedding (the "rotate half" layout used by Llama and Qwen checkpoints)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kernels import cpu_kernels, cuda_kernels
from minisgl.kernels.cuda import FLASHINFER_HEAD_DIMS
from minisgl.layers.base import Layer


def _inverse_frequencies(head_dim: int, rope: dict[str, Any], positions: int
                         ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, the factor cos and sin are scaled by) of a RoPE configuration, for
    a table of `positions` (the served context)."""
    theta = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_positions = rope.get("max_position_embeddings") or positions  # the config's
    if kind in ("default", "dynamic"):
        # NOTE: dynamic NTK changes the base only past max_position_embeddings, which the
        # served context never is (ModelArch.context_limit): below, it is the default
        return inv_freq, 1.0
    if kind in ("longrope", "su"):
        return _longrope(exponents, theta, rope, positions, max_positions)
    if kind == "llama3":
        factor = rope["factor"]
        low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        old_ctx = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "proportional":
        # Gemma 4's global layers: the frequencies of the whole head, of which only the first
        # partial_rotary_factor share turn; the others are 0, so those pairs pass unrotated
        turning = int(rope.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        return inv_freq / rope.get("factor", 1.0), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, head_dim, theta, rope, max_positions)
    raise ValueError(f"unsupported RoPE scaling type {kind!r} (supported: default, linear, "
                     "llama3, yarn, longrope, dynamic, proportional)")


def _longrope(exponents: torch.Tensor, theta: float, rope: dict[str, Any], positions: int,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each dimension's frequency divided by its own factor, the
    `short_factor`s for a table of up to original_max_position_embeddings positions, the
    `long_factor`s for a longer one (LongRopeSwitch says which rows a sequence reads); cos and
    sin scaled by sqrt(1 + ln(factor) / ln(original)), whichever set."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    long = positions > original
    factors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (factors * theta ** exponents), float(attention)


@dataclass(frozen=True)
class LongRopeSwitch:
    """LongRoPE served past its original context. As in transformers, vLLM and SGLang, a
    sequence rotates with the short factors while it is within `original` tokens and with the
    long ones past it, decided per sequence: a prompt longer than `original` rotates with the
    long factors from its first token; a shorter one with the short factors, and its tokens
    from position `original` on with the long ones (its earlier keys keep their rotation).

    The rotary table holds the short factors' rows below `original`, the long factors' from
    there to `offset` (the served context), and at `offset + p` the long factors' rows of the
    positions p below `original`: a token's position is its row except in a long prompt."""

    original: int
    offset: int

    def long_prompt(self, prompt_len: int) -> bool:
        return prompt_len > self.original

    def table_rows(self, positions: torch.Tensor, starts: list[int], counts: list[int],
                   prompt_lens: list[int]) -> torch.Tensor | None:
        """Each token's row of the table, for a forward whose sequences run from `starts`
        for `counts` tokens (`positions`: theirs, concatenated); None where every row is the
        token's position."""
        rows, first = None, 0
        for start, count, prompt_len in zip(starts, counts, prompt_lens):
            below = min(start + count, self.original) - start
            if below > 0 and self.long_prompt(prompt_len):
                rows = positions.clone() if rows is None else rows
                rows[first:first + below] += self.offset
            first += count
        return rows


def long_rope_switch(rope: dict[str, Any], positions: int) -> LongRopeSwitch | None:
    """The switch of a LongRoPE table of `positions` (the served context) past its original
    context; None for any other RoPE, or within the original context (the short factors)."""
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return None
    original = rope["original_max_position_embeddings"]
    return LongRopeSwitch(original, positions) if positions > original else None


def yarn_mscale(scale: float, weight: float = 1.0) -> float:
    """YaRN's magnitude factor for a context `scale` times the original."""
    return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, rope: dict[str, Any],
          max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the
    pretraining context are interpolated by `factor`, those that turn more than `beta_fast`
    times are kept, a linear ramp blends the ones between; cos and sin are scaled by the
    attention factor (0.1 ln(factor) + 1 unless the config gives it)."""
    old_ctx = rope.get("original_max_position_embeddings") or max_positions
    factor = rope.get("factor") or max_positions / old_ctx
    attention = rope.get("attention_factor")
    if attention is None:
        weight, weight_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = (yarn_mscale(factor, weight) / yarn_mscale(factor, weight_all)
                     if weight and weight_all else yarn_mscale(factor))

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(rope.get("beta_fast") or 32), dimension(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


class RotaryEmbedding(Layer):
    """With `rotary_dim` < head_dim (a partial_rotary_factor: Phi-4-mini) only each head's
    first rotary_dim dimensions rotate, with frequencies over rotary_dim; the rest pass."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict[str, Any],
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, scale = _inverse_frequencies(self.rotary_dim, rope, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        switch = long_rope_switch(rope, max_positions)
        if switch is not None:  # inv_freq: the long factors' (see LongRopeSwitch)
            original = switch.original
            short, _ = _inverse_frequencies(self.rotary_dim, rope, original)
            freqs = torch.cat((torch.outer(torch.arange(original, dtype=torch.float32), short),
                               freqs[original:], freqs[:original]))
        # [rows, head_dim/2], scaled as the RoPE type says (YaRN's attention factor); a row per
        # position, and LongRoPE's long prompts' rows after them
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        self._cos_sin: torch.Tensor | None = None  # [max_positions, head_dim] (CUDA kernel)
        # multimodal RoPE (Qwen-VL): which of a token's temporal, height and width positions
        # turns each rotated pair; None for a 1-D RoPE
        sections = rope.get("mrope_section")
        self.axes = (None if sections is None else
                     mrope_axes(sections, rope.get("mrope_interleaved", False),
                                self.rotary_dim // 2))
        self._per_token: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, rotary_dim/2], in x's dtype
        half = cos.shape[-1]
        x1, x2, passed = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:  # [3, tokens]: a table of one row per token, in order
            cos, sin = self.per_token(positions)
            rows = torch.arange(positions.shape[1], device=positions.device)
            return self._apply(rows, q, k, cos, sin, per_token=True)
        return self._apply(positions, q, k, self.cos, self.sin)

    def _apply(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, per_token: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by rows `positions` of the table (cos, sin): this layer's, or
        (`per_token`) one made for this forward."""
        fused = cuda_kernels(q)
        # NOTE: FlashInfer 0.6.1 runs other head sizes through its RoPE-quantize kernel, not
        # verified here: LoRA adapters at head size 16 on an H200 missed the reference there
        if (fused is not None and q.stride(-1) == 1 and k.stride(-1) == 1
                and self.head_dim in FLASHINFER_HEAD_DIMS):
            if per_token:
                cos_sin = torch.cat((cos, sin), dim=-1).float()
            elif self._cos_sin is None or self._cos_sin.device != q.device:
                # NOTE: made at the first (eager) forward, before any CUDA-graph capture
                cos_sin = self._cos_sin = torch.cat((self.cos, self.sin), dim=-1).float()
            else:
                cos_sin = self._cos_sin
            fused.apply_rope_with_cos_sin_cache_inplace(  # float32 math, in place
                positions, q, k, self.head_dim, cos_sin, is_neox=True)
            return q, k
        kernels = cpu_kernels() if q.device.type == "cpu" else None
        if (kernels is not None and _heads_contiguous(q) and _heads_contiguous(k)
                and positions.dtype == torch.int64 and cos.dtype == torch.float32):
            kernels.rotary_(q, k, positions, cos, sin)  # float32 math, in place
            return q, k
        # NOTE: like the reference implementations, the angles are computed in float32 and
        # applied in the activation dtype.
        cos_rows = cos[positions].unsqueeze(1).to(q.dtype)
        sin_rows = sin[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos_rows, sin_rows), self._rotate(k, cos_rows, sin_rows)

    def per_token(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE's [3, tokens] positions as a (cos, sin) table of one row per token,
        each rotated pair from its own axis's row; made once per forward (every layer gets
        the same positions tensor)."""
        if self._per_token is not None and self._per_token[0] is positions:
            return self._per_token[1]
        if self.axes is None:
            raise ValueError("[3, tokens] positions for a RoPE without a valid mrope_section")
        axes = self.axes.to(positions.device).view(1, 1, -1).expand(1, positions.shape[1], -1)
        tables = tuple(table[positions].gather(0, axes)[0] for table in (self.cos, self.sin))
        self._per_token = (positions, tables)
        return tables

    def rotate_queries(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q alone, for a layer that attends to keys another layer rotated."""
        if q.device.type == "cpu":  # the kernel rotates in place; no keys: zero heads of them
            return self(positions, q, q[:, :0])[0]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, self.sin[positions].unsqueeze(1).to(q.dtype))


def rotate_rows(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ([tokens, heads, dim]) each token by its own row of cos / sin ([tokens, dim/2],
    float32), the head's halves paired, in float32 (a vision tower's 2D RoPE); on CPU by the
    compiled kernel, in place on contiguous copies."""
    kernels = cpu_kernels() if q.device.type == "cpu" else None
    if kernels is not None and cos.dtype == torch.float32:
        q, k = q.contiguous(), k.contiguous()
        kernels.rotary_(q, k, torch.arange(q.shape[0]), cos, sin)
        return q, k
    cos, sin = cos[:, None], sin[:, None]

    def turned(x: torch.Tensor) -> torch.Tensor:
        first, second = x.float().chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin],
                         dim=-1).to(x.dtype)

    return turned(q), turned(k)


def mrope_axes(sections: list[int], interleaved: bool, pairs: int) -> torch.Tensor | None:
    """[pairs] 0, 1 or 2: the position (temporal, height, width) each rotated pair turns by.
    In sections: the first sections[0] pairs, then sections[1], then sections[2] (Qwen2-VL,
    Qwen2.5-VL); interleaved (Qwen3-VL): pairs 1, 4, 7, ... by height and 2, 5, 8, ... by
    width, each for its section's count, the others temporal. None if the sections do not
    split the pairs (such a model serves text, where every axis turns alike)."""
    if len(sections) < 3 or any(sections[3:]) or sum(sections) != pairs:
        return None
    sections = list(sections[:3])
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))
    axes = torch.zeros(pairs, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis:3 * sections[axis]:3] = axis
    return axes


class NoRotary:
    """Attention without positions (NoPE: Granite's and Nemotron-H's layers, SmolLM3's every
    fourth)."""

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

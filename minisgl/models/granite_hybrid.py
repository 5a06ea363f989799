"""Granite 4.0-H (GraniteMoeHybridForCausalLM): a hybrid decoder whose linear layers are Mamba2
(a state-space scan with a [head_dim, d_state] state per head, kvcache.state_pool) beside a few
attention layers over the paged KV pool, each layer's MLP a shared MLP plus, in the MoE
variants, routed experts.

Granite's multipliers: embeddings times `embedding_multiplier`, attention scores times
`attention_multiplier` (in place of head_dim^-0.5), each sublayer's output times
`residual_multiplier` before its residual add, logits divided by `logits_scaling` (folded into
the final norm's weight at load: the LM head is linear). Attention has no RoPE unless
`position_embedding_type` is "rope".

The state per request follows models.qwen3_next's rule: a prefill from position 0 starts it from
zero; every later chunk, decode step or mixed row continues it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers import Layer, NoRotary, RMSNorm, RotaryEmbedding, RowParallelLinear
from minisgl.layers.linear import PartedColumnParallelLinear, PartedParameters
from minisgl.layers.moe import SparseMoE
from minisgl.layers.shard import load_head_rows, read_all
from minisgl.models.arch import MambaShape, ModelArch
from minisgl.models.llama import MLP, Attention
from minisgl.models.moe import MoEForCausalLM
from minisgl.models.qwen3_next import (HybridStack, PerHeadFloats, RowSpans, save_snapshot,
                                       state_step_kernels, step_spans)

SCAN_CHUNK = 64  # tokens per block of the blocked scan
# Hub names of the MoE block -> ours (models.moe reads the experts' stacked tensors)
MOE_NAMES = {".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
             ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
             ".block_sparse_moe.router.layer.weight": ".mlp.gate.weight"}


def mamba2_recurrence(x: torch.Tensor, dt: torch.Tensor, log_a: torch.Tensor, b: torch.Tensor,
                      c: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's tokens through the scan, token by token (float32): per head,
    h <- exp(dt_t a) h + dt_t x_t b_t^T; y_t = h c_t. x [L, heads, P], dt [L, heads],
    log_a [heads] (a < 0), b and c [L, heads, N]; `state` [heads, P, N] updated in place.
    Returns y [L, heads, P] (without the D skip)."""
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        state.mul_(torch.exp(dt[t] * log_a)[:, None, None])
        state.add_((dt[t, :, None] * x[t])[:, :, None] * b[t, :, None, :])
        out[t] = torch.einsum("hpn,hn->hp", state, c[t])
    return out


def mamba2_blocked(x: torch.Tensor, dt: torch.Tensor, log_a: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, state: torch.Tensor, chunk: int = SCAN_CHUNK) -> torch.Tensor:
    """mamba2_recurrence in blocks: with G the running sum of dt a within a block from state
    h0, y_t = exp(G_t) h0 c_t + sum_{j <= t} exp(G_t - G_j) (c_t . b_j) dt_j x_j and the state
    after it exp(G_last) h0 + sum_j exp(G_last - G_j) dt_j x_j b_j^T."""
    length = x.shape[0]
    out = torch.empty_like(x)
    x, b, c = x.transpose(0, 1), b.transpose(0, 1), c.transpose(0, 1)  # [heads, L, .]
    dt = dt.t()
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        size = end - start
        dtc = dt[:, start:end]
        logs = (dtc * log_a[:, None]).cumsum(-1)  # G [heads, C]
        lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        decay = torch.where(lower, logs[:, :, None] - logs[:, None, :], float("-inf")).exp()
        xd = x[:, start:end] * dtc[:, :, None]  # dt_j x_j
        cc, bc = c[:, start:end], b[:, start:end]
        y = (cc @ bc.transpose(1, 2) * decay) @ xd + logs.exp()[:, :, None] * (
            cc @ state.transpose(1, 2))
        out[start:end] = y.transpose(0, 1)
        last = logs[:, -1:]
        state.mul_(last.exp()[:, :, None]).add_(
            (xd * (last - logs).exp()[:, :, None]).transpose(1, 2) @ bc)
    return out


class Mamba2Mixer(Layer):
    """Under tensor parallelism a rank holds whole groups of B and C with their heads
    (`shape`: its share; the fused projection's and convolution's parts each split)."""

    def __init__(self, arch: ModelArch, linear_id: int) -> None:
        super().__init__()
        full = arch.linear
        assert isinstance(full, MambaShape)
        self.shape, self.linear_id = full.split(get_tp_info().size), linear_id
        bc = full.groups * full.d_state
        self.in_proj = PartedColumnParallelLinear(
            arch.hidden_size, [full.inner, full.inner, bc, bc, full.heads], bias=full.proj_bias)
        conv = {"weight": (full.conv_dim, 1, full.conv_kernel)}
        self.conv1d = PartedParameters([full.inner, bc, bc], **conv, **(
            {"bias": (full.conv_dim,)} if full.conv_bias else {}))
        if not full.conv_bias:
            self.conv1d.bias = None
        heads = self.shape.heads
        self.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads), requires_grad=False)
        # gated, per group of inner // groups channels
        self.norm = PartedParameters([full.inner], weight=(full.inner,))
        self.eps = arch.rms_norm_eps
        self.out_proj = RowParallelLinear(full.inner, arch.hidden_size, bias=full.proj_bias)
        self.states: StatePool | None = None  # bound by the engine (bind_states)
        self._per_head = PerHeadFloats()

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        """dt_bias, A_log and D: this rank's heads."""
        load_head_rows(getattr(self, name), source, name)

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dt_bias, log a (= -exp(A_log)) and D, float32 (PerHeadFloats)."""
        return self._per_head(self.dt_bias, self.A_log, self.D)  # type: ignore[return-value]

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """The causal convolution's outputs over `window` [rows, conv_dim, K - 1 + L], SiLU'd:
        [rows, L, conv_dim]."""
        weight = self.conv1d.weight
        out = F.conv1d(window.to(weight.dtype), weight, self.conv1d.bias,
                       groups=self.shape.conv_dim)
        return F.silu(out).transpose(1, 2)

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, heads, P], b and c [T, heads, N] (each head its group's), float32."""
        s, tokens = self.shape, conv.shape[0]
        x, b, c = conv.float().split([s.inner, s.groups * s.d_state, s.groups * s.d_state], -1)
        per_group = s.heads // s.groups
        b = b.view(tokens, s.groups, s.d_state).repeat_interleave(per_group, dim=1)
        c = c.view(tokens, s.groups, s.d_state).repeat_interleave(per_group, dim=1)
        return x.view(tokens, s.heads, s.head_dim), b, c

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, log_a: torch.Tensor, rows: torch.Tensor,
              conv_states: torch.Tensor, ssm_states: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of several requests (their states in table `rows`) at once: the
        convolution's last position and one step of the scan. Returns (y without the D skip,
        the convolution's x), [rows, heads, P] each."""
        window = torch.cat([conv_states[rows], xbc[:, :, None].to(conv_states.dtype)], -1)
        conv_states[rows] = window[:, :, 1:]
        xs, b, c = self._heads(self._conv(window)[:, -1])
        state = ssm_states[rows]  # [rows, heads, P, N]
        state.mul_(torch.exp(dt * log_a)[:, :, None, None])
        state.add_((dt[:, :, None] * xs)[:, :, :, None] * b[:, :, None, :])
        ssm_states[rows] = state
        return torch.einsum("rhpn,rhn->rhp", state, c), xs

    def forward(self, x: torch.Tensor, spans: RowSpans) -> torch.Tensor:
        s, states = self.shape, self.states
        assert states is not None, "the engine binds a state pool to a hybrid model"
        tokens = x.shape[0]
        proj = self.in_proj(x)
        conv_states, ssm_states = states.layer(self.linear_id)
        dt_bias, log_a, skip = self.per_head()
        weight, bias = self.conv1d.weight, self.conv1d.bias
        kernels = state_step_kernels(conv_states, proj, weight, bias)
        if kernels is not None:  # NOTE: one call from proj to out_proj's input
            return self.out_proj(step_spans(
                spans, conv_states, ssm_states, lambda first, end, rows, counts:
                kernels.mamba2_spans(proj[first:end], weight, bias, conv_states, ssm_states, rows,
                                     counts, dt_bias, log_a, skip, self.norm.weight, s.groups,
                                     *s.dt_limit, self.eps)))
        gate, xbc, dt = proj.split([s.inner, s.conv_dim, s.heads], dim=-1)
        dt = F.softplus(dt.float() + dt_bias).clamp(*s.dt_limit)
        out = torch.empty(tokens, s.heads, s.head_dim, dtype=torch.float32, device=x.device)
        inputs = torch.empty(tokens, s.heads, s.head_dim, dtype=torch.float32, device=x.device)
        stepping = [i for i, (count, fresh) in enumerate(zip(spans.counts, spans.fresh))
                    if count == 1 and not fresh]
        if stepping:  # NOTE: decode rows (also a mixed batch's): one batched step for all
            at = torch.tensor([spans.starts[i] for i in stepping], device=x.device)
            rows = torch.tensor([spans.rows[i] for i in stepping], device=x.device)
            out[at], inputs[at] = self._step(xbc[at], dt[at], log_a, rows, conv_states,
                                             ssm_states)
        for i, (start, count, row, fresh) in enumerate(zip(spans.starts, spans.counts,
                                                             spans.rows, spans.fresh)):
            if count == 1 and not fresh:
                continue
            end = start + count
            window = torch.cat([conv_states[row], xbc[start:end].t().to(conv_states.dtype)], -1)
            conv_states[row].copy_(window[:, window.shape[1] - (s.conv_kernel - 1):])
            xs, b, c = self._heads(self._conv(window[None])[0])
            for lo, hi, slot in spans.pieces(i):
                out[start + lo:start + hi] = mamba2_blocked(
                    xs[lo:hi], dt[start + lo:start + hi], log_a, b[lo:hi], c[lo:hi],
                    ssm_states[row])
                if slot is not None:
                    save_snapshot(conv_states, ssm_states, row, slot, window, hi)
            inputs[start:end] = xs
        y = (out + inputs * skip[:, None]).view(tokens, -1)
        y = y * F.silu(gate.float())
        grouped = y.view(tokens, s.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.norm.weight * grouped.view(tokens, -1).to(x.dtype)
        return self.out_proj(normed)


class GraniteHybridLayer(Layer):
    def __init__(self, arch: ModelArch, mixer: Layer, moe: Layer | None, shared_mlp: Layer,
                 residual_multiplier: float) -> None:
        super().__init__()
        self.is_linear = isinstance(mixer, Mamba2Mixer)
        if self.is_linear:  # NOTE: the checkpoint's names for the two kinds of mixer
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.mlp = moe
        self.shared_mlp = shared_mlp
        self.residual_multiplier = residual_multiplier
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    @property
    def linear_mixer(self) -> Mamba2Mixer:
        return self.mamba

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend, spans: RowSpans
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.mamba(x, spans) if self.is_linear else self.self_attn(x, positions, batch,
                                                                       backend)
        x, residual = self.post_attention_layernorm(x * self.residual_multiplier, residual)
        out = self.shared_mlp(x)
        if self.mlp is not None:
            out = out + self.mlp(x)
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(HybridStack, MoEForCausalLM):
    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        config = arch.config
        rope = config.get("position_embedding_type") == "rope"
        rotary = (RotaryEmbedding(arch.head_dim, arch.rope_positions, arch.rope, arch.rotary_dim)
                  if rope else NoRotary())
        shared = dataclasses.replace(arch, intermediate_size=config["shared_intermediate_size"])
        scale = float(config.get("attention_multiplier") or arch.head_dim ** -0.5)
        layers, linear_id, kv_index = [], 0, 0
        for kind in arch.layer_types:
            mixer: Layer
            if kind == "linear_attention":
                mixer, linear_id = Mamba2Mixer(arch, linear_id), linear_id + 1
            else:
                mixer, kv_index = Attention(arch, kv_index, rotary), kv_index + 1
                mixer.query_scale = scale / arch.head_dim ** -0.5  # the backend's scale
            moe = None
            if arch.moe is not None:
                moe = SparseMoE(arch.hidden_size, arch.moe.num_experts, arch.moe.top_k,
                                arch.moe.intermediate_size, arch.moe.renormalize)
            layers.append(GraniteHybridLayer(arch, mixer, moe, MLP(shared),
                                             float(config.get("residual_multiplier", 1.0))))
        return nn.ModuleList(layers)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a Hub checkpoint of this model, for --load-format
        dummy."""
        arch, hidden, config = self.arch, self.arch.hidden_size, self.arch.config
        s = arch.linear
        assert isinstance(s, MambaShape)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        shared = config["shared_intermediate_size"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size,
                                                                            hidden)}
        for i, kind in enumerate(arch.layer_types):
            p = f"model.layers.{i}."
            shapes.update({p + "input_layernorm.weight": (hidden,),
                           p + "post_attention_layernorm.weight": (hidden,),
                           p + "shared_mlp.input_linear.weight": (2 * shared, hidden),
                           p + "shared_mlp.output_linear.weight": (hidden, shared)})
            if arch.moe is not None:
                e, inter = arch.moe.num_experts, arch.moe.intermediate_size
                shapes.update({p + "block_sparse_moe.input_linear.weight": (e, 2 * inter, hidden),
                               p + "block_sparse_moe.output_linear.weight": (e, hidden, inter),
                               p + "block_sparse_moe.router.layer.weight": (e, hidden)})
            if kind != "linear_attention":
                shapes.update({p + "self_attn.q_proj.weight": (q, hidden),
                               p + "self_attn.k_proj.weight": (kv, hidden),
                               p + "self_attn.v_proj.weight": (kv, hidden),
                               p + "self_attn.o_proj.weight": (hidden, q)})
                continue
            m = p + "mamba."
            shapes.update({m + "in_proj.weight": (s.inner + s.conv_dim + s.heads, hidden),
                           m + "conv1d.weight": (s.conv_dim, 1, s.conv_kernel),
                           m + "dt_bias": (s.heads,), m + "A_log": (s.heads,), m + "D": (s.heads,),
                           m + "norm.weight": (s.inner,), m + "out_proj.weight": (hidden, s.inner)})
            if s.conv_bias:
                shapes[m + "conv1d.bias"] = (s.conv_dim,)
            if s.proj_bias:
                shapes.update({m + "in_proj.bias": (s.inner + s.conv_dim + s.heads,),
                               m + "out_proj.bias": (hidden,)})
        shapes["model.norm.weight"] = (hidden,)
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
        return shapes

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * float(
            self.arch.config.get("embedding_multiplier", 1.0))

    def load_weight(self, name: str, source: Any) -> bool:
        for hub, ours in MOE_NAMES.items():
            if name.endswith(hub):
                name = name.removesuffix(hub) + ours
        if name.endswith(".shared_mlp.input_linear.weight"):
            gate, up = read_all(source).chunk(2, dim=0)
            prefix = name.removesuffix("input_linear.weight")
            return (super().load_weight(prefix + "gate_proj.weight", gate)
                    and super().load_weight(prefix + "up_proj.weight", up))
        if name.endswith(".shared_mlp.output_linear.weight"):
            name = name.removesuffix("output_linear.weight") + "down_proj.weight"
        if name == "model.norm.weight":  # NOTE: logits / logits_scaling, folded in here
            scaling = float(self.arch.config.get("logits_scaling") or 1.0)
            source = read_all(source).float() / scaling
        return super().load_weight(name, source)

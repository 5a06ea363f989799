"""Qwen3-Next and Qwen3.5 (text; dense or with experts): hybrid decoders. Most layers mix
tokens with Gated DeltaNet, a linear attention whose state per request is fixed in size (a
convolution window and a [heads, key, value] matrix, kvcache.state_pool); every few layers
(`layer_types`) keep full attention, gated by a sigmoid of a second query projection, over
the paged KV pool. Its MLPs are experts with a shared expert behind a sigmoid gate (Qwen3.5:
dense MLPs, or experts in every layer). Qwen3.5's multimodal RoPE reduces to plain RoPE for
text (its three position ids are equal).

Per request, a Gated DeltaNet layer reads and writes its state in the request's table row:
a prefill that starts at position 0 starts from zero; every later chunk, decode step or mixed
row continues the state the steps before it left (the engine runs steps in launch order).

Checkpoint quirks: the decoder norms multiply by (1 + w) (the checkpoint's w is loaded plus
one, as for Gemma), the DeltaNet's output norm by w; q_proj holds each head's query then its
gate; in_proj_qkvz and in_proj_ba group their outputs by key head.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.kernels.cpu import cpu_kernels
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers import (ColumnParallelLinear, Layer, QKVParallelLinear, RMSNorm,
                            RotaryEmbedding, RowParallelLinear)
from minisgl.layers.linear import PartedColumnParallelLinear, PartedParameters
from minisgl.layers.moe import SparseMoE
from minisgl.layers.shard import load_head_rows, read_all
from minisgl.models.arch import LinearAttnShape, ModelArch
from minisgl.models.llama import MLP, with_image_embeddings
from minisgl.models.moe import MoEForCausalLM
from minisgl.models.weights import text_model_name


# A Qwen3.5 checkpoint's multi-token-prediction head is not served (its vision tower:
# models.qwen3_5_vision).
SKIPPED_PREFIXES = ("mtp.",)


@dataclass(frozen=True)
class RowSpans:
    """A batch's token rows per request: `counts[i]` tokens from `starts[i]` of the flat batch,
    its state in table row `rows[i]`, `fresh[i]`: it starts at position 0 (the stack zeroes
    its state before the layers run).
    `cuts[i]`: (tokens, slot) pairs, in order: the state after that many of the span's tokens
    is saved into row `slot` of the state pool (a prefix-cache snapshot, a verify step's
    scratch; a save at a span's end is the stack's, `HybridStack`)."""

    starts: list[int]
    counts: list[int]
    rows: list[int]
    fresh: list[bool]
    cuts: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, batch: Batch) -> RowSpans:
        size = batch.size
        if batch.is_decode and not batch.extend_lens:
            counts, cached = [1] * size, [1] * size
        else:
            counts, cached = batch.extend_lens[:size], batch.cached_lens[:size]
        starts, at = [], 0
        for count in counts:
            starts.append(at)
            at += count
        rows = list(batch.table_rows[:size])
        cuts: dict[int, list[tuple[int, int]]] = {}
        for row, tokens, slot in sorted(batch.state_saves or ()):
            i = rows.index(row)
            if tokens < counts[i]:
                cuts.setdefault(i, []).append((tokens, slot))
        return cls(starts, list(counts), rows, [c == 0 for c in cached], cuts)

    @functools.cached_property
    def decode_rows(self) -> torch.Tensor | None:
        """The table rows, when every span is one token that continues its state (a decode
        batch: a linear layer's kernel steps them all in one call); else None."""
        if any(count != 1 for count in self.counts) or any(self.fresh):
            return None
        return self.tensors[0]

    @functools.cached_property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The spans' table rows and token counts, as the CPU kernels take them."""
        return (torch.tensor(self.rows, dtype=torch.long),
                torch.tensor(self.counts, dtype=torch.long))

    def pieces(self, i: int) -> list[tuple[int, int, int | None]]:
        """Span i as (first token, end, the row its state after them is saved to, or None)."""
        pieces, first = [], 0
        for tokens, slot in self.cuts.get(i, ()):
            pieces.append((first, tokens, slot))
            first = tokens
        return [*pieces, (first, self.counts[i], None)]


def save_snapshot(conv_states: torch.Tensor, ssm_states: torch.Tensor, row: int, slot: int,
                  window: torch.Tensor, tokens: int) -> None:
    """Row `row`'s state after `tokens` tokens of its span into snapshot `slot`: the recurrent
    state as it stands, the conv window as the K - 1 inputs before that token (`window`: the
    span's inputs after the K - 1 before it, [channels, K - 1 + count])."""
    ssm_states[slot].copy_(ssm_states[row])
    conv_states[slot].copy_(window[:, tokens:tokens + conv_states.shape[-1]])


def step_spans(spans: RowSpans, conv_states: torch.Tensor, ssm_states: torch.Tensor,
               run: Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
    """A batch through a linear layer's span kernel, `run(first, end, rows, counts)`: the
    batch's tokens [first, end) as spans of `counts` tokens whose states are in table `rows`.
    With no snapshot to take, the whole batch is one call, else each piece between cuts is
    one, its state copied into its slot after it."""
    if not spans.cuts:
        return run(0, spans.starts[-1] + spans.counts[-1], *spans.tensors)
    outs = []
    for i, (start, row) in enumerate(zip(spans.starts, spans.rows)):
        for lo, hi, slot in spans.pieces(i):
            outs.append(run(start + lo, start + hi, torch.tensor([row]),
                            torch.tensor([hi - lo])))
            if slot is not None:
                conv_states[slot].copy_(conv_states[row])
                ssm_states[slot].copy_(ssm_states[row])
    return torch.cat(outs)


class PerHeadFloats:
    """A linear layer's per-head vectors as its kernel takes them, float32: dt_bias, log a
    (= -exp(A_log)), and any others as they are; made again only after one of them changed (a
    tensor's version counts its in-place writes)."""

    def __init__(self) -> None:
        self._made: tuple[tuple[int, ...], tuple[torch.Tensor, ...]] | None = None

    def __call__(self, dt_bias: torch.Tensor, a_log: torch.Tensor, *others: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
        params = (dt_bias, a_log, *others)
        versions = tuple(p._version for p in params)
        if self._made is None or self._made[0] != versions:
            self._made = (versions, (dt_bias.float().contiguous(),
                                     -a_log.float().exp().contiguous(),
                                     *(p.float().contiguous() for p in others)))
        return self._made[1]


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's tokens through the gated delta rule, in float32: per token t and head,
    S <- S * exp(decay_t); S <- S + k_t (beta_t (v_t - S^T k_t))^T; out_t = S^T q_t.
    q, k [L, heads, dk] (normalized, q scaled), v [L, heads, dv], decay and beta [L, heads];
    `state` [heads, dk, dv] is updated in place. Returns [L, heads, dv]."""
    out = torch.empty_like(v)
    gates = decay.exp()
    for t in range(q.shape[0]):
        state.mul_(gates[t, :, None, None])
        recalled = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - recalled) * beta[t, :, None]
        state.add_(k[t, :, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


DELTA_CHUNK = 64  # tokens per block of the chunked form


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                             chunk: int = DELTA_CHUNK) -> torch.Tensor:
    """gated_delta_rule in blocks of `chunk` tokens, its sequential part a triangular solve per
    block. Within a block from state S0, with G the running sum of the decays (Γ = exp G):
    the deltas d_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t) solve (I + diag(beta) M) d =
    beta (V - Γ K S0), M[t, j] = exp(G_t - G_j) k_t.k_j for j < t; then
    out = Γ Q S0 + (Q K^T * exp(G_t - G_j), j <= t) d and S = Γ_last S0 + (K exp(G_last -
    G))^T d. Same arguments and result as gated_delta_rule."""
    length = q.shape[0]
    out = torch.empty_like(v)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, L, d]
    decay, beta = decay.t(), beta.t()  # [heads, L]
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        logs = decay[:, start:end].cumsum(-1)  # G [heads, C]
        diff = logs[:, :, None] - logs[:, None, :]  # G_t - G_j
        size = end - start
        lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        within = torch.where(lower, diff, float("-inf")).exp()  # exp(G_t - G_j), j <= t
        strict = within.masked_fill(torch.eye(size, dtype=torch.bool, device=q.device), 0.0)
        system = torch.eye(size, device=q.device) + bc[:, :, None] * (kc @ kc.transpose(1, 2)
                                                                      * strict)
        gamma = logs.exp()[:, :, None]
        rhs = bc[:, :, None] * (vc - gamma * (kc @ state))
        deltas = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[start:end] = ((gamma * qc) @ state
                          + (qc @ kc.transpose(1, 2) * within) @ deltas).transpose(0, 1)
        last = logs[:, -1:]
        state.mul_(last.exp()[:, :, None]).add_(
            ((last - logs).exp()[:, :, None] * kc).transpose(1, 2) @ deltas)
    return out


def state_step_kernels(conv_states: torch.Tensor, *tensors: torch.Tensor | None) -> Any | None:
    """The CPU kernels that run a linear layer's spans in place in the state pool, where they
    apply: on CPU, the conv windows and `tensors` (the inputs, the conv's weight and bias)
    in one dtype, float32 or bfloat16."""
    dtype = conv_states.dtype
    if (conv_states.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16)
            or any(t is not None and t.dtype != dtype for t in tensors)):
        return None
    return cpu_kernels()


class GatedDeltaNet(Layer):
    """Under tensor parallelism a rank holds whole key heads with their value heads (`shape`:
    its share; a fused checkpoint tensor's q, k and v each split), its states only theirs."""

    def __init__(self, arch: ModelArch, linear_id: int) -> None:
        super().__init__()
        full = arch.linear
        assert isinstance(full, LinearAttnShape)
        self.shape, self.linear_id = full.split(get_tp_info().size), linear_id
        self.group = full.num_v_heads // full.num_k_heads
        key_dim, value_dim = full.key_dim, full.value_dim
        if full.grouped:  # NOTE: grouped by key head, so a rank's rows are its heads' already
            self.in_proj_qkvz = ColumnParallelLinear(arch.hidden_size,
                                                     2 * key_dim + 2 * value_dim)
            self.in_proj_ba = ColumnParallelLinear(arch.hidden_size, 2 * full.num_v_heads)
        else:
            self.in_proj_qkv = PartedColumnParallelLinear(arch.hidden_size,
                                                          [key_dim, key_dim, value_dim])
            self.in_proj_z = ColumnParallelLinear(arch.hidden_size, value_dim)
            self.in_proj_b = ColumnParallelLinear(arch.hidden_size, full.num_v_heads)
            self.in_proj_a = ColumnParallelLinear(arch.hidden_size, full.num_v_heads)
        self.conv1d = PartedParameters([key_dim, key_dim, value_dim],
                                       weight=(full.conv_dim, 1, full.conv_kernel))
        heads = self.shape.num_v_heads
        self.dt_bias = nn.Parameter(torch.ones(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads), requires_grad=False)
        self.norm = RMSNorm(full.v_head_dim, arch.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, arch.hidden_size)
        self.states: StatePool | None = None  # bound by the engine (bind_states)
        self._per_head = PerHeadFloats()

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        """dt_bias and A_log: this rank's value heads."""
        load_head_rows(getattr(self, name), source, name)

    def per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """dt_bias and log a (= -exp(A_log)), float32 (PerHeadFloats)."""
        return self._per_head(self.dt_bias, self.A_log)  # type: ignore[return-value]

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v before the convolution [T, conv_dim]; z [T, nv dv]; b, a [T, nv]) from the
        input projections."""
        s, tokens = self.shape, x.shape[0]
        if not s.grouped:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x).view(tokens, s.num_k_heads, -1)
        ba = self.in_proj_ba(x).view(tokens, s.num_k_heads, 2 * self.group)
        wide = self.group * s.v_head_dim
        q, k, v, z = qkvz.split([s.k_head_dim, s.k_head_dim, wide, wide], dim=-1)
        b, a = ba.split([self.group, self.group], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1),
                           v.reshape(tokens, -1)], dim=-1)
        return (mixed, z.reshape(tokens, -1), b.reshape(tokens, -1), a.reshape(tokens, -1))

    def _heads(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (normalized, scaled), k (normalized) and v per value head, float32, from the
        convolution's output [tokens, conv_dim]."""
        s, tokens = self.shape, conv.shape[0]
        q, k, v = conv.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalized(q.reshape(tokens, s.num_k_heads, -1)) * s.k_head_dim ** -0.5
        k = l2_normalized(k.reshape(tokens, s.num_k_heads, -1))
        if self.group > 1:
            q = q.repeat_interleave(self.group, dim=1)
            k = k.repeat_interleave(self.group, dim=1)
        return q, k, v.reshape(tokens, -1, s.v_head_dim)

    def _step(self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
              rows: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor
              ) -> torch.Tensor:
        """One token of each of several requests (their states in table `rows`) at once: the
        convolution's last position and one step of the delta rule."""
        window = torch.cat([conv_states[rows], mixed[:, :, None].to(conv_states.dtype)], dim=-1)
        conv_states[rows] = window[:, :, 1:]
        weight = self.conv1d.weight[:, 0, :]
        conv = F.silu((window.to(weight.dtype) * weight).sum(-1))  # [rows, conv_dim]
        q, k, v = self._heads(conv)
        state = ssm_states[rows]  # [rows, heads, dk, dv]
        state.mul_(decay.exp()[:, :, None, None])
        delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[:, :, None]
        state.add_(k[:, :, :, None] * delta[:, :, None, :])
        ssm_states[rows] = state
        return torch.einsum("bhkv,bhk->bhv", state, q)

    def forward(self, x: torch.Tensor, spans: RowSpans) -> torch.Tensor:
        s, states = self.shape, self.states
        assert states is not None, "the engine binds a state pool to a hybrid model"
        mixed, z, b, a = self._projections(x)
        tokens = x.shape[0]
        conv_states, ssm_states = states.layer(self.linear_id)
        weight = self.conv1d.weight
        kernels = state_step_kernels(conv_states, mixed, weight)
        if kernels is not None:
            per_head = self.per_head()
            return self.out_proj(step_spans(
                spans, conv_states, ssm_states, lambda first, end, rows, counts:
                kernels.gated_delta_layer(mixed[first:end], z[first:end], b[first:end],
                                          a[first:end], weight, conv_states, ssm_states, rows,
                                          counts, *per_head, self.norm.weight, self.norm.eps,
                                          s.num_k_heads, s.tiled)))
        beta = torch.sigmoid(b.float())
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if spans.decode_rows is not None:  # a decode batch: every row steps, none gathered
            out = self._step(mixed, decay, beta, spans.decode_rows.to(x.device), conv_states,
                             ssm_states)
        else:
            out = self._spans(mixed, decay, beta, spans, conv_states, ssm_states)
        normed = self.norm.forward_plain(out.to(x.dtype).view(-1, s.v_head_dim))
        gated = normed.float() * F.silu(z.reshape(-1, s.v_head_dim).float())
        if s.tiled:  # NOTE: value head j of key head h sits at j * num_k_heads + h
            gated = gated.view(tokens, s.num_k_heads, self.group, -1).transpose(1, 2)
        return self.out_proj(gated.to(x.dtype).reshape(tokens, -1))

    def _spans(self, mixed: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
               spans: RowSpans, conv_states: torch.Tensor, ssm_states: torch.Tensor
               ) -> torch.Tensor:
        """A batch with prefill spans: its decode rows (a mixed batch's) in one step, each
        span of several tokens (or a first one) through the chunked delta rule, its state
        saved at its cuts. Returns [tokens, nv, dv] float32."""
        s, tokens, device = self.shape, mixed.shape[0], mixed.device
        weight = self.conv1d.weight
        out = torch.empty(tokens, s.num_v_heads, s.v_head_dim, dtype=torch.float32,
                          device=device)
        stepping = [i for i, (count, fresh) in enumerate(zip(spans.counts, spans.fresh))
                    if count == 1 and not fresh]
        if stepping:
            at = torch.tensor([spans.starts[i] for i in stepping], device=device)
            rows = torch.tensor([spans.rows[i] for i in stepping], device=device)
            out[at] = self._step(mixed[at], decay[at], beta[at], rows, conv_states, ssm_states)
        for i, (start, count, row, fresh) in enumerate(zip(spans.starts, spans.counts,
                                                             spans.rows, spans.fresh)):
            if count == 1 and not fresh:
                continue
            end = start + count
            window = torch.cat([conv_states[row], mixed[start:end].t().to(conv_states.dtype)],
                               dim=-1)
            conv_states[row].copy_(window[:, window.shape[1] - (s.conv_kernel - 1):])
            conv = F.silu(F.conv1d(window[None].to(weight.dtype), weight,
                                   groups=s.conv_dim))[0].t()  # [count, conv_dim]
            rq, rk, rv = self._heads(conv)
            for lo, hi, slot in spans.pieces(i):
                out[start + lo:start + hi] = chunked_gated_delta_rule(
                    rq[lo:hi], rk[lo:hi], rv[lo:hi], decay[start + lo:start + hi],
                    beta[start + lo:start + hi], ssm_states[row])
                if slot is not None:
                    save_snapshot(conv_states, ssm_states, row, slot, window, hi)
        return out


class GatedAttention(Layer):
    """Full attention whose output is gated per element by sigmoid(a second query)."""

    def __init__(self, arch: ModelArch, kv_index: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.kv_index, self.head_dim, self.rotary = kv_index, arch.head_dim, rotary
        # NOTE: its q shard is each head's query then gate: 2 x heads of head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, 2 * arch.num_heads,
                                          arch.num_kv_heads, bias=arch.attention_bias)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        bias=arch.attention_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend) -> torch.Tensor:
        tokens, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.view(tokens, -1, 2 * d).split([d, d], dim=-1)
        q = self.q_norm.forward_plain(q.contiguous())
        k = self.k_norm.forward_plain(k.view(tokens, -1, d))
        q, k = self.rotary(positions, q, k)
        out = backend.forward(q, k, v.view(tokens, -1, d), self.kv_index, batch)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class SharedExpertMoE(SparseMoE):
    """Routed experts plus a shared expert whose output a sigmoid gate scales per token."""

    def __init__(self, arch: ModelArch) -> None:
        moe = arch.moe
        assert moe is not None
        super().__init__(arch.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                         moe.renormalize)
        width = arch.config.get("shared_expert_intermediate_size") or 0
        self.shared_expert = MLP(dataclasses.replace(arch, intermediate_size=width))
        self.shared_expert_gate = nn.Module()  # NOTE: one output: every rank holds it whole
        self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, arch.hidden_size),
                                                      requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
        shared = self.shared_expert(x) * gate
        return super().forward(x) + shared


class HybridDecoderLayer(Layer):
    def __init__(self, arch: ModelArch, layer_id: int, mixer: Layer, mlp: Layer) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.is_linear = isinstance(mixer, GatedDeltaNet)
        if self.is_linear:  # NOTE: the checkpoint's names for the two kinds of mixer
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    @property
    def linear_mixer(self) -> GatedDeltaNet:
        return self.linear_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend, spans: RowSpans
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            x = self.linear_attn(x, spans)
        else:
            x = self.self_attn(x, positions, batch, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridStack:
    """What every hybrid decoder shares: its linear layers read the engine's state pool
    (`bind_states`), and each layer runs with the batch's row spans. Its layers say whether
    they are linear (`is_linear`) and name their linear mixer (`linear_mixer`)."""

    layers: nn.ModuleList
    states: StatePool

    def bind_states(self, states: StatePool) -> None:
        self.states = states
        for layer in self.layers:
            if layer.is_linear:
                layer.linear_mixer.states = states

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                      backend: AttentionBackend, rows: torch.Tensor | None) -> torch.Tensor:
        spans = RowSpans.of(batch)
        states = self.states  # type: ignore[attr-defined]
        if batch.state_loads:  # requests admitted on a cached prefix resume from its snapshot
            states.copy(*map(list, zip(*batch.state_loads)))
        # a span from position 0 starts from zero states
        states.clear([row for row, fresh in zip(spans.rows, spans.fresh) if fresh])
        x, residual = with_image_embeddings(self.embed(input_ids), batch), None  # type: ignore
        fused = self.fused_layers  # type: ignore[attr-defined]
        if fused is not None and not spans.cuts and fused.runs(batch, positions):
            x, residual = fused(x, positions, batch, backend, spans.tensors)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions, batch, backend, spans)
        ends = [(row, slot) for row, tokens, slot in batch.state_saves or ()
                if tokens == spans.counts[spans.rows.index(row)]]
        if ends:  # the state at a span's end is the row's own after the forward
            states.copy(*map(list, zip(*ends)))
        x, _ = self.norm(x, residual)  # type: ignore[attr-defined]
        return x if rows is None else x.index_select(0, rows)


class Qwen3NextForCausalLM(HybridStack, MoEForCausalLM):
    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        rotary = RotaryEmbedding(arch.head_dim, arch.rope_positions, self.rope(arch),
                                 arch.rotary_dim)
        layers, linear_id, kv_index = [], 0, 0
        for i, kind in enumerate(arch.layer_types):
            mixer: Layer
            if kind == "linear_attention":
                mixer, linear_id = GatedDeltaNet(arch, linear_id), linear_id + 1
            else:
                mixer, kv_index = GatedAttention(arch, kv_index, rotary), kv_index + 1
            mlp = self.layer_mlp(arch, i) or MLP(arch)
            layers.append(HybridDecoderLayer(arch, i, mixer, mlp))
        return nn.ModuleList(layers)

    def rope(self, arch: ModelArch) -> dict[str, Any]:
        return arch.rope

    def layer_mlp(self, arch: ModelArch, layer_id: int) -> Layer | None:
        if arch.moe is None or layer_id not in arch.moe.sparse_layers:
            return None
        return SharedExpertMoE(arch)

    def load_weight(self, name: str, source: Any) -> bool:
        if name.startswith(SKIPPED_PREFIXES):
            return True  # a multimodal checkpoint's vision tower; the multi-token predictor
        name = text_model_name(name)
        if (name.endswith("norm.weight") and ".linear_attn.norm." not in name
                and not self.skips(name)):
            source = read_all(source).float() + 1.0  # (1 + w), see the module's docstring
        return super().load_weight(name, source)


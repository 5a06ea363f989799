"""The CPU kernels of a hybrid model's linear layers (kernels/csrc/hybrid_state.cpp): spans of
tokens (a decode row's one, a prefill chunk's many) through a Gated DeltaNet or Mamba2 layer,
the convolution window and the recurrent state stepped in place in the state pool, equal to the
token-by-token reference (gated_delta_rule) and to the layers' forward on torch ops (the chunked
forms), for several requests in scattered table rows whose key heads or B/C groups are shared
by several heads, with snapshots taken part-way; the other rows untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels.cpu import cpu_kernels
from minisgl.models import qwen3_next
from minisgl.models.arch import ModelArch
from minisgl.models.granite_hybrid import Mamba2Mixer
from minisgl.models.qwen3_next import GatedDeltaNet, gated_delta_rule, l2_normalized

# max |kernel - reference| of outputs and states (values of order 1): float32 math both sides,
# summed in another order
TOLERANCE = 2e-5
# bfloat16 states (their 32-column blocks run AVX-512 BF16 where built), relative to the
# largest value: a rounding that lands the other way where the sums' order differs
BF16_STATE_RELATIVE = 2 ** -7
# against the layers' torch step in bfloat16, which rounds the convolution's products and
# output to bfloat16 where the kernel keeps float32: relative to the largest output
BF16_RELATIVE = 3e-2
POOL_ROWS = 8
ROWS = [4, 1, 3]  # scattered and out of order; rows 0, 2 and 5 must stay as they were
COUNTS = [1, 5, 3]  # a decode row's token and two prefill spans
KERNEL = 4


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels()
    if built is None:
        pytest.skip("the CPU kernels are not built here")
    return built


def conv_reference(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One span's tokens [count, channels] after a window [channels, K - 1]: (SiLU of the
    convolution at each token in float32, the shifted window)."""
    window = torch.cat([window, inputs.t()], dim=-1)
    taps = window.float().unfold(-1, weight.shape[-1], 1)  # [channels, count, K]
    out = (taps * weight[:, :, :].float()).sum(-1).t()
    if bias is not None:
        out = out + bias.float()
    return F.silu(out), window[:, -(weight.shape[-1] - 1):]


def assert_rows_stepped(before: torch.Tensor, after: torch.Tensor, expected: torch.Tensor,
                        tolerance: float) -> None:
    others = [r for r in range(POOL_ROWS) if r not in ROWS]
    assert torch.equal(after[others], before[others])
    torch.testing.assert_close(after[ROWS].to(expected.dtype), expected, rtol=0, atol=tolerance)


def span_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(ROWS), torch.tensor(COUNTS)


def rule_rounding_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                         state_dtype: torch.dtype) -> torch.Tensor:
    """gated_delta_rule token by token on a float32 `state`, rounded to `state_dtype` after
    each token as the kernel stores it."""
    outs = []
    for t in range(q.shape[0]):
        outs.append(gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1],
                                     beta[t:t + 1], state))
        state.copy_(state.to(state_dtype).float())
    return torch.cat(outs)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nk, nv, dk, dv", [(2, 4, 16, 40), (1, 1, 8, 8), (2, 2, 32, 64)])
def test_gated_delta_spans_are_the_delta_rule(kernels, dtype, state_dtype, nk, nv, dk, dv
                                              ) -> None:
    gen = torch.Generator().manual_seed(nk * 100 + dv)
    n, conv_dim = sum(COUNTS), 2 * nk * dk + nv * dv
    mixed = torch.randn(n, conv_dim, generator=gen).to(dtype)
    weight = (torch.randn(conv_dim, 1, KERNEL, generator=gen) * 0.5).to(dtype)
    windows = torch.randn(POOL_ROWS, conv_dim, KERNEL - 1, generator=gen).to(dtype)
    states = torch.randn(POOL_ROWS, nv, dk, dv, generator=gen).to(state_dtype)
    decay, beta = -torch.rand(n, nv, generator=gen), torch.rand(n, nv, generator=gen)
    windows_before, states_before = windows.clone(), states.clone()

    out = kernels.gated_delta_spans(mixed, weight, windows, states, *span_tensors(), decay,
                                    beta, nk)

    expected, expected_states, shifted, start = [], states_before[ROWS].float(), [], 0
    for i, (row, count) in enumerate(zip(ROWS, COUNTS)):
        end = start + count
        conv, window = conv_reference(mixed[start:end], weight, None, windows_before[row])
        shifted.append(window)
        q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q = (l2_normalized(q.view(count, nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, 1)
        k = l2_normalized(k.view(count, nk, dk)).repeat_interleave(nv // nk, dim=1)
        expected.append(rule_rounding_states(q, k, v.reshape(count, nv, dv), decay[start:end],
                                             beta[start:end], expected_states[i], state_dtype))
        start = end
    expected_out = torch.cat(expected)
    if state_dtype == torch.float32:
        out_tolerance = state_tolerance = TOLERANCE
    else:
        out_tolerance = BF16_STATE_RELATIVE * expected_out.abs().max().item()
        state_tolerance = BF16_STATE_RELATIVE * expected_states.abs().max().item()
    torch.testing.assert_close(out, expected_out, rtol=0, atol=out_tolerance)
    assert_rows_stepped(states_before, states, expected_states, state_tolerance)
    assert_rows_stepped(windows_before, windows, torch.stack(shifted), 0.0)


@pytest.mark.parametrize("rows, counts, message", [
    ([4, 4], [1, 1], "two spans"), ([1, 9], [1, 1], "out of range"),
    ([1, 3], [2, 2], "sum to the tokens"), ([1, 3], [3, 0], "no tokens")])
def test_the_span_kernels_refuse_spans_that_do_not_fit(kernels, rows, counts, message) -> None:
    windows = torch.zeros(POOL_ROWS, 2 * 8 + 8, KERNEL - 1)
    states = torch.zeros(POOL_ROWS, 1, 8, 8)
    with pytest.raises(RuntimeError, match=message):
        kernels.gated_delta_spans(torch.zeros(3, 24), torch.zeros(24, 1, KERNEL), windows,
                                  states, torch.tensor(rows), torch.tensor(counts),
                                  torch.zeros(3, 1), torch.zeros(3, 1), 1)


def tiny_arch(config: dict) -> ModelArch:
    return ModelArch.from_config({"rms_norm_eps": 1e-6, "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "num_key_value_heads": 1,
                                  "head_dim": 16,
                                  "layer_types": ["linear_attention", "full_attention"],
                                  **config})


class Recording:
    """The kernels, noting which ones are called."""

    def __init__(self, kernels) -> None:
        self.kernels, self.called = kernels, []

    def __getattr__(self, name: str):
        self.called.append(name)
        return getattr(self.kernels, name)


def assert_steps_agree(dtype: torch.dtype, kernel: tuple, torch_step: tuple) -> None:
    windows, states = kernel[-2:]
    assert torch.equal(windows, torch_step[-2])  # the same shifts of the same values
    if dtype == torch.float32:
        for ours, theirs in zip(kernel, torch_step):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=TOLERANCE)
        return
    for ours, theirs in zip(kernel[:-2] + (states,), torch_step[:-2] + (torch_step[-1],)):
        scale = theirs.abs().max().item()
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0,
                                   atol=BF16_RELATIVE * scale)


class Pool:
    def __init__(self, windows: torch.Tensor, states: torch.Tensor) -> None:
        self.windows, self.states = windows, states

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows, self.states


def linear_layer(kind: str, dtype: torch.dtype) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """A tiny Mamba2 or Gated DeltaNet layer with random weights, and its state's shape."""
    torch.manual_seed(0)
    if kind == "mamba2":
        arch = tiny_arch({"architectures": ["GraniteMoeHybridForCausalLM"],
                          "model_type": "granitemoehybrid", "shared_intermediate_size": 32,
                          "num_local_experts": 0, "mamba_n_heads": 4, "mamba_d_head": 8,
                          "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_expand": 1,
                          "mamba_d_conv": KERNEL, "time_step_limit": [0.05, 2.0]})
        layer = Mamba2Mixer(arch, 0)
        state = (layer.shape.heads, layer.shape.head_dim, layer.shape.d_state)
    else:
        arch = tiny_arch({"architectures": ["Qwen3_5ForCausalLM"],
                          "model_type": "qwen3_5_text", "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                          "linear_value_head_dim": 24, "linear_conv_kernel_dim": KERNEL})
        layer = GatedDeltaNet(arch, 0)
        state = (layer.shape.num_v_heads, layer.shape.k_head_dim, layer.shape.v_head_dim)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    return layer.to(dtype), state


BATCHES = {  # spans in ROWS: decode rows; a decode row, a fresh span and a continued one, each
    # of the two with a snapshot part-way (into pool rows 6 and 7)
    "decode": qwen3_next.RowSpans([0, 1, 2], [1, 1, 1], ROWS, [False] * 3),
    "mixed": qwen3_next.RowSpans([0, 1, 6], COUNTS, ROWS, [False, True, False],
                                 cuts={1: [(2, 6)], 2: [(1, 7)]}),
}


LAYER_KERNELS = {"mamba2": "mamba2_spans", "gated_delta": "gated_delta_layer"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(LAYER_KERNELS))
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_a_batch_of_spans_through_the_kernels_equals_the_torch_forward(
        kernels, dtype, kind, batch, monkeypatch) -> None:
    """The layer's forward with its kernel (one call a batch, or one a piece between
    snapshots) against its forward on torch ops (a decode step for one-token spans, the
    chunked form for the others): outputs, windows, states and snapshots."""
    layer, state = linear_layer(kind, dtype)
    spans = BATCHES[batch]
    tokens = spans.starts[-1] + spans.counts[-1]
    x = torch.randn(tokens, layer.out_proj.weight.shape[0]).to(dtype)
    conv_dim = layer.conv1d.weight.shape[0]
    pool = (torch.randn(POOL_ROWS, conv_dim, KERNEL - 1).to(dtype),
            torch.randn(POOL_ROWS, *state))

    def forward(built) -> tuple[torch.Tensor, ...]:
        layer.states = Pool(pool[0].clone(), pool[1].clone())
        recording = Recording(built) if built is not None else None
        with monkeypatch.context() as patch:
            patch.setattr(qwen3_next, "cpu_kernels", lambda: recording)
            with torch.inference_mode():
                out = layer(x, qwen3_next.RowSpans(spans.starts, spans.counts, spans.rows,
                                                   spans.fresh, spans.cuts))
        if recording is not None:
            assert set(recording.called) == {LAYER_KERNELS[kind]}
        return out, layer.states.windows, layer.states.states

    assert_steps_agree(dtype, forward(kernels), forward(None))


def kernel_inputs(kind: str, generator: torch.Generator) -> list:
    """One mixed batch's arguments of a layer kernel: 18 tokens in spans of 5, 11, 1 and 1
    (the first two continuing their state); small heads (a Gated DeltaNet's value heads of 8,
    a Mamba2 state of 12, past its blocks of 8)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    rows, counts = torch.tensor([2, 3, 0, 1]), torch.tensor([5, 11, 1, 1])
    if kind == "gated_delta":
        nk, nv, dk, dv = 2, 8, 8, 8
        conv_dim = 2 * nk * dk + nv * dv
        return [randn(18, conv_dim), randn(18, nv * dv), randn(18, nv), randn(18, nv),
                randn(conv_dim, 1, KERNEL) * 0.5, randn(POOL_ROWS, conv_dim, KERNEL - 1),
                randn(POOL_ROWS, nv, dk, dv), rows, counts, randn(nv), -torch.rand(nv),
                randn(dv), 1e-6, nk, True]
    heads, head_dim, groups, d_state = 4, 8, 2, 12
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * d_state
    return [randn(18, inner + conv_dim + heads), randn(conv_dim, 1, KERNEL) * 0.5,
            randn(conv_dim), randn(POOL_ROWS, conv_dim, KERNEL - 1),
            randn(POOL_ROWS, heads, head_dim, d_state), rows, counts, randn(heads),
            -torch.rand(heads), randn(heads), randn(inner), groups, 1e-3, 100.0, 1e-6]


@pytest.mark.parametrize("kind", sorted(LAYER_KERNELS))
def test_the_kernels_give_the_same_bits_wherever_their_buffers_lie(kernels, kind) -> None:
    """One batch again and again, fresh copies of its inputs each time while other
    allocations come and go: a loop vectorised behind a run-time check that its buffers do
    not overlap ran its scalar copy whenever the allocator put them close, and under fast
    math that copy rounds otherwise."""
    generator = torch.Generator().manual_seed(0)
    inputs = kernel_inputs(kind, generator)
    kernel = getattr(kernels, LAYER_KERNELS[kind])
    held, outs = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: the kernel's scratch then comes from this thread's arena
    try:
        for _ in range(2000):
            held.append(torch.empty(int(torch.randint(1, 4096, (1,), generator=generator))))
            if len(held) > 16:
                held.pop(int(torch.randint(0, len(held), (1,), generator=generator)))
            outs.append(kernel(*(x.clone() if isinstance(x, torch.Tensor) else x
                                 for x in inputs)))
    finally:
        torch.set_num_threads(threads)
    differing = sum(not torch.equal(out, outs[0]) for out in outs)
    assert differing == 0, f"{differing} of {len(outs)} calls differ from the first"

"""The CPU kernels of a hybrid model's decode step (kernels/csrc/hybrid_state.cpp): a Gated
DeltaNet or Mamba2 layer's convolution window, convolution and recurrent state stepped in place
in the state pool, equal to the token-by-token references (gated_delta_rule,
mamba2_recurrence) and to the layers' torch step, for several requests in scattered table rows
whose key heads or B/C groups are shared by several heads; the other rows untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernels.cpu import cpu_kernels
from minisgl.models import qwen3_next
from minisgl.models.arch import ModelArch
from minisgl.models.granite_hybrid import Mamba2Mixer, mamba2_recurrence
from minisgl.models.qwen3_next import GatedDeltaNet, gated_delta_rule, l2_normalized

# max |kernel - reference| of outputs and states (values of order 1): float32 math both sides,
# summed in another order
TOLERANCE = 2e-5
# against the layers' torch step in bfloat16, which rounds the convolution's products and
# output to bfloat16 where the kernel keeps float32: relative to the largest output
BF16_RELATIVE = 3e-2
POOL_ROWS = 6
ROWS = [4, 1, 3]  # scattered and out of order; rows 0, 2 and 5 must stay as they were
KERNEL = 4


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels()
    if built is None:
        pytest.skip("the CPU kernels are not built here")
    return built


def conv_reference(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(SiLU of the convolution's last position in float32, the shifted windows)."""
    window = torch.cat([windows, inputs[:, :, None]], dim=-1)
    out = (window.float() * weight[:, 0, :].float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out), window[:, :, 1:]


def assert_rows_stepped(before: torch.Tensor, after: torch.Tensor, expected: torch.Tensor,
                        tolerance: float) -> None:
    others = [r for r in range(POOL_ROWS) if r not in ROWS]
    assert torch.equal(after[others], before[others])
    torch.testing.assert_close(after[ROWS], expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nk, nv, dk, dv", [(2, 4, 16, 40), (1, 1, 8, 8), (2, 2, 32, 64)])
def test_gated_delta_step_is_the_delta_rule(kernels, dtype, nk, nv, dk, dv) -> None:
    gen = torch.Generator().manual_seed(nk * 100 + dv)
    n, conv_dim = len(ROWS), 2 * nk * dk + nv * dv
    mixed = torch.randn(n, conv_dim, generator=gen).to(dtype)
    weight = (torch.randn(conv_dim, 1, KERNEL, generator=gen) * 0.5).to(dtype)
    windows = torch.randn(POOL_ROWS, conv_dim, KERNEL - 1, generator=gen).to(dtype)
    states = torch.randn(POOL_ROWS, nv, dk, dv, generator=gen)
    decay, beta = -torch.rand(n, nv, generator=gen), torch.rand(n, nv, generator=gen)
    windows_before, states_before = windows.clone(), states.clone()

    out = kernels.gated_delta_step(mixed, weight, windows, states, torch.tensor(ROWS), decay,
                                   beta, nk)

    conv, shifted = conv_reference(mixed, weight, None, windows_before[ROWS])
    q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q = (l2_normalized(q.view(n, nk, dk)) * dk ** -0.5).repeat_interleave(nv // nk, dim=1)
    k = l2_normalized(k.view(n, nk, dk)).repeat_interleave(nv // nk, dim=1)
    expected_states = states_before[ROWS]
    expected = torch.stack([
        gated_delta_rule(q[i, None], k[i, None], v[i, None].view(1, nv, dv), decay[i, None],
                         beta[i, None], expected_states[i])[0] for i in range(n)])
    torch.testing.assert_close(out, expected, rtol=0, atol=TOLERANCE)
    assert_rows_stepped(states_before, states, expected_states, TOLERANCE)
    assert_rows_stepped(windows_before, windows, shifted, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, groups, head_dim, d_state, bias",
                         [(4, 2, 8, 16, True), (3, 1, 5, 7, False), (8, 8, 16, 32, True)])
def test_mamba2_step_is_the_recurrence(kernels, dtype, heads, groups, head_dim, d_state,
                                       bias) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    n, conv_dim = len(ROWS), heads * head_dim + 2 * groups * d_state
    # the inputs a view with a row stride of its own, as a split of the input projection
    xbc = torch.randn(n, conv_dim + 3, generator=gen).to(dtype)[:, 3:]
    weight = (torch.randn(conv_dim, 1, KERNEL, generator=gen) * 0.5).to(dtype)
    conv_bias = torch.randn(conv_dim, generator=gen).to(dtype) if bias else None
    windows = torch.randn(POOL_ROWS, conv_dim, KERNEL - 1, generator=gen).to(dtype)
    states = torch.randn(POOL_ROWS, heads, head_dim, d_state, generator=gen)
    dt, log_a = torch.rand(n, heads, generator=gen), -4 * torch.rand(heads, generator=gen)
    windows_before, states_before = windows.clone(), states.clone()

    y, xs = kernels.mamba2_step(xbc, weight, conv_bias, windows, states, torch.tensor(ROWS), dt,
                                log_a, groups)

    conv, shifted = conv_reference(xbc, weight, conv_bias, windows_before[ROWS])
    x, b, c = conv.split([heads * head_dim, groups * d_state, groups * d_state], dim=-1)
    b = b.view(n, groups, d_state).repeat_interleave(heads // groups, dim=1)
    c = c.view(n, groups, d_state).repeat_interleave(heads // groups, dim=1)
    x = x.view(n, heads, head_dim)
    expected_states = states_before[ROWS]
    expected = torch.stack([
        mamba2_recurrence(x[i, None], dt[i, None], log_a, b[i, None], c[i, None],
                          expected_states[i])[0] for i in range(n)])
    torch.testing.assert_close(xs, x, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(y, expected, rtol=0, atol=TOLERANCE)
    assert_rows_stepped(states_before, states, expected_states, TOLERANCE)
    assert_rows_stepped(windows_before, windows, shifted, 0.0)


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


def stepped(step, inputs: tuple, pool: tuple[torch.Tensor, torch.Tensor], kernels,
            monkeypatch) -> tuple:
    """The layer's step on a copy of the pool, with the kernels or (None) torch ops: (its
    outputs..., windows, states)."""
    windows, states = pool[0].clone(), pool[1].clone()
    recording = Recording(kernels) if kernels is not None else None
    with monkeypatch.context() as patch:
        patch.setattr(qwen3_next, "cpu_kernels", lambda: recording)
        out = step(*inputs, torch.tensor(ROWS), windows, states)
    assert recording is None or recording.called, "the step ran on the kernels"
    return (*(out if isinstance(out, tuple) else (out,)), windows, states)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_net_step_equals_its_torch_step(kernels, dtype, monkeypatch) -> None:
    torch.manual_seed(0)
    arch = tiny_arch({"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                      "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                      "linear_key_head_dim": 16, "linear_value_head_dim": 24,
                      "linear_conv_kernel_dim": KERNEL})
    layer = GatedDeltaNet(arch, 0)
    s = layer.shape
    layer.conv1d.weight.data = (torch.randn(s.conv_dim, 1, KERNEL) * 0.5).to(dtype)
    n = len(ROWS)
    inputs = (torch.randn(n, s.conv_dim).to(dtype), -torch.rand(n, s.num_v_heads),
              torch.rand(n, s.num_v_heads))
    pool = (torch.randn(POOL_ROWS, s.conv_dim, KERNEL - 1).to(dtype),
            torch.randn(POOL_ROWS, s.num_v_heads, s.k_head_dim, s.v_head_dim))
    assert_steps_agree(dtype, stepped(layer._step, inputs, pool, kernels, monkeypatch),
                       stepped(layer._step, inputs, pool, None, monkeypatch))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba2_mixer_step_equals_its_torch_step(kernels, dtype, monkeypatch) -> None:
    torch.manual_seed(0)
    arch = tiny_arch({"architectures": ["GraniteMoeHybridForCausalLM"],
                      "model_type": "granitemoehybrid", "shared_intermediate_size": 32,
                      "num_local_experts": 0, "mamba_n_heads": 4, "mamba_d_head": 8,
                      "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_expand": 1,
                      "mamba_d_conv": KERNEL})
    layer = Mamba2Mixer(arch, 0)
    s = layer.shape
    layer.conv1d.weight.data = (torch.randn(s.conv_dim, 1, KERNEL) * 0.5).to(dtype)
    if layer.conv1d.bias is not None:
        layer.conv1d.bias.data = torch.randn(s.conv_dim).to(dtype)
    n = len(ROWS)
    inputs = (torch.randn(n, s.conv_dim).to(dtype), torch.rand(n, s.heads),
              -torch.rand(s.heads))
    pool = (torch.randn(POOL_ROWS, s.conv_dim, KERNEL - 1).to(dtype),
            torch.randn(POOL_ROWS, s.heads, s.head_dim, s.d_state))
    assert_steps_agree(dtype, stepped(layer._step, inputs, pool, kernels, monkeypatch),
                       stepped(layer._step, inputs, pool, None, monkeypatch))


class Pool:
    def __init__(self, windows: torch.Tensor, states: torch.Tensor) -> None:
        self.windows, self.states = windows, states

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.windows, self.states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mamba2_decode_batch_in_one_kernel_call_equals_the_torch_forward(
        kernels, dtype, monkeypatch) -> None:
    """mamba2_decode (dt, convolution, scan, D skip, gate, group norm between the two
    projections) against the layer's forward on torch ops."""
    torch.manual_seed(0)
    arch = tiny_arch({"architectures": ["GraniteMoeHybridForCausalLM"],
                      "model_type": "granitemoehybrid", "shared_intermediate_size": 32,
                      "num_local_experts": 0, "mamba_n_heads": 4, "mamba_d_head": 8,
                      "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_expand": 1,
                      "mamba_d_conv": KERNEL, "time_step_limit": [0.05, 2.0]})
    layer = Mamba2Mixer(arch, 0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.5)
    layer.to(dtype)
    s, n = layer.shape, len(ROWS)
    x = torch.randn(n, arch.hidden_size).to(dtype)
    spans = qwen3_next.RowSpans(list(range(n)), [1] * n, ROWS, [False] * n)
    pool = (torch.randn(POOL_ROWS, s.conv_dim, KERNEL - 1).to(dtype),
            torch.randn(POOL_ROWS, s.heads, s.head_dim, s.d_state))

    def forward(built) -> tuple[torch.Tensor, ...]:
        layer.states = Pool(pool[0].clone(), pool[1].clone())
        recording = Recording(built) if built is not None else None
        with monkeypatch.context() as patch:
            patch.setattr(qwen3_next, "cpu_kernels", lambda: recording)
            with torch.inference_mode():
                out = layer(x, spans)
        assert recording is None or recording.called == ["mamba2_decode"]
        return out, layer.states.windows, layer.states.states

    assert_steps_agree(dtype, forward(kernels), forward(None))

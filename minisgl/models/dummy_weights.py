"""Random ("dummy") weights that do not depend on the tensor-parallel size.

Every tensor parallel size must run the same model. So every checkpoint tensor (Hugging Face
naming of the Llama family: Llama, Mistral, Qwen2, Qwen3, and Phi-3 and Gemma 3 as their
unfused parts, Qwen3-MoE and Mixtral with Qwen3-MoE's per-expert names, the hybrids Qwen3-Next
and Qwen3.5 with their Gated DeltaNet layers and shared experts) is drawn whole from a
generator seeded by its name and `--seed`, then handed to `model.load_weight` like a real
checkpoint tensor, so each rank keeps exactly its shard of the same model. Norm weights (and
Gemma 4's layer scalars) are 1, everything else N(0, 0.02); with `int4` (`--quantization gguf`), the layers' linear weights
(not the experts') are random 4-bit blocks instead, of about the same spread (codes uniform in
0..15, scale 0.02 / 4.6, zero 0), never dense; with `int4_groups` (`--quantization awq`,
`gptq` or `compressed-tensors` on CUDA), int4 groups of 128 of that spread (zero point 8) in
the form such a checkpoint loads into (layers.gpu_blocks); with `mxfp4` (`--quantization
mxfp4`), stacked experts (gpt-oss's) are MXFP4 blocks per expert as the released checkpoints
hold them (codes uniform, every block's scale 2^-7: about that spread too).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from minisgl.env import return_freed_heap
from minisgl.layers.gguf_weight import GgufBlocks
from minisgl.layers.quant import GROUP, WeightBlocks
from minisgl.models.gguf_decode import mxfp4_blocks

INT4_SCALE = 0.02 / 4.6  # codes - 8 uniform in [-8, 7] have a standard deviation of ~4.6
INT4_GROUP = 128  # the usual group size of AWQ / GPTQ checkpoints
MXFP4_EXPONENT = 120  # 2^-7: E2M1 values of uniform codes have a standard deviation of ~2.9


def checkpoint_shapes(arch: Any) -> dict[str, tuple[int, ...]]:
    """Name -> full shape of every tensor of a Llama-family checkpoint for `arch`."""
    hidden, head_dim, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * head_dim, arch.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, hidden)}
    shared = arch.config.get("shared_expert_intermediate_size") or 0
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
        if arch.layer_types and arch.layer_types[i] == "linear_attention":
            shapes.update(linear_attention_shapes(p + "linear_attn.", arch))
        else:
            gated = 2 if arch.is_hybrid else 1  # a hybrid's query carries its output gate
            shapes.update({
                p + "self_attn.q_proj.weight": (gated * q, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, q),
            })
        if arch.moe is not None and i in arch.moe.sparse_layers:
            shapes[p + "mlp.gate.weight"] = (arch.moe.num_experts, hidden)
            for e in range(arch.moe.num_experts):
                shapes.update(mlp_shapes(f"{p}mlp.experts.{e}.", hidden,
                                         arch.moe.intermediate_size))
            if shared:
                shapes.update(mlp_shapes(p + "mlp.shared_expert.", hidden, shared))
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
        else:
            shapes.update(mlp_shapes(p + "mlp.", hidden, inter))
        if arch.layer_types and arch.layer_types[i] == "linear_attention":
            continue
        if arch.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if arch.qk_norm or arch.is_hybrid:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,),
                           p + "self_attn.k_norm.weight": (head_dim,)})
        if arch.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):  # around the MLP
            shapes.update({p + "pre_feedforward_layernorm.weight": (hidden,),
                           p + "post_feedforward_layernorm.weight": (hidden,)})
    shapes["model.norm.weight"] = (hidden,)
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    return shapes


def linear_attention_shapes(prefix: str, arch: Any) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors, in its family's projection layout."""
    s, hidden = arch.linear, arch.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "conv1d.weight": (s.conv_dim, 1, s.conv_kernel),
        prefix + "dt_bias": (s.num_v_heads,), prefix + "A_log": (s.num_v_heads,),
        prefix + "norm.weight": (s.v_head_dim,),
        prefix + "out_proj.weight": (hidden, s.value_dim)}
    if s.grouped:
        shapes.update({prefix + "in_proj_qkvz.weight": (2 * s.key_dim + 2 * s.value_dim, hidden),
                       prefix + "in_proj_ba.weight": (2 * s.num_v_heads, hidden)})
    else:
        shapes.update({prefix + "in_proj_qkv.weight": (2 * s.key_dim + s.value_dim, hidden),
                       prefix + "in_proj_z.weight": (s.value_dim, hidden),
                       prefix + "in_proj_b.weight": (s.num_v_heads, hidden),
                       prefix + "in_proj_a.weight": (s.num_v_heads, hidden)})
    return shapes


def mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {prefix + "gate_proj.weight": (inter, hidden),
            prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def is_layer_linear(name: str) -> bool:
    """A linear layer's weight (experts' weights are not: they stay dense under int4)."""
    return (name.startswith("model.layers.") and name.endswith("proj.weight")
            and ".experts." not in name)


def is_stacked_experts(name: str, shape: tuple[int, ...]) -> bool:
    return ".mlp.experts." in name and name.endswith("_proj") and len(shape) == 3


def load_dummy(model: nn.Module, arch: Any, seed: int, device: torch.device,
               dtype: torch.dtype, int4: bool = False, int4_groups: bool = False,
               mxfp4: bool = False) -> None:
    # a model of another naming than the Llama family's says its own (models.nemotron_h)
    own = getattr(model, "checkpoint_shapes", None)
    shapes = own() if own is not None else checkpoint_shapes(arch)
    if int4_groups:
        for name in filter(is_layer_linear, shapes):
            model.weight_target(name)[0].expect_gguf_blocks()
    if mxfp4:
        stacked = [name for name, shape in shapes.items() if is_stacked_experts(name, shape)]
        if not stacked:
            raise ValueError("--quantization mxfp4: this model has no stacked experts "
                             "(gpt-oss's) to hold MXFP4 blocks")
        for name in stacked:
            model.weight_target(name)[0].expect_gguf_blocks()
    if int4:
        for name in filter(is_layer_linear, shapes):
            module = model.weight_target(name)[0]
            if not isinstance(module.weight, WeightBlocks):
                module.expect_blocks()
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.fill_(float("nan"))
    for name, shape in shapes.items():
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith(("norm.weight", "layer_scalar")):
            full = torch.ones(shape, dtype=dtype, device=device)
        elif int4 and is_layer_linear(name):
            codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8, device=device)
            scales = torch.full((shape[0], shape[1] // GROUP), INT4_SCALE, device=device)
            full = WeightBlocks(codes, scales, torch.zeros_like(scales))
        elif int4_groups and is_layer_linear(name):
            full = random_int4_groups(shape, gen, device)
        elif mxfp4 and is_stacked_experts(name, shape):
            full = random_mxfp4_experts(shape, gen)
        else:
            full = torch.empty(shape, dtype=torch.float32, device=device).normal_(
                0.0, 0.02, generator=gen).to(dtype)
        if not model.load_weight(name, full):
            raise ValueError(f"dummy weights: the model has no place for {name}")
        del full
        experts = model.weight_target(name)[0] if mxfp4 else None
        if getattr(experts, "blocks_complete", False):
            experts.finish_blocks(dtype, device)  # NOTE: a layer's unpacked codes at a time
            return_freed_heap()
    missing = [n for n, p in params.items() if torch.isnan(p).any()]
    if missing:
        raise ValueError(f"dummy weights left parameters unfilled: {missing[:5]}")


def random_mxfp4_experts(shape: tuple[int, ...], gen: torch.Generator) -> list[GgufBlocks]:
    """Stacked experts [E, in, out] (the checkpoint's dense form) as MXFP4 blocks per expert,
    output-major as the released checkpoints store them."""
    experts, in_features, out = shape
    exponents = torch.full((out, in_features // GROUP), MXFP4_EXPONENT, dtype=torch.uint8)
    return [mxfp4_blocks(torch.randint(0, 16, (out, in_features), generator=gen,
                                       dtype=torch.uint8), exponents) for _ in range(experts)]


def random_int4_groups(shape: tuple[int, ...], gen: torch.Generator, device: torch.device
                       ) -> GgufBlocks:
    """"W4" blocks (layers.gguf_weight) of random codes, groups of INT4_GROUP (or the row)."""
    out, in_features = shape
    group = INT4_GROUP if in_features % INT4_GROUP == 0 else in_features
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8, device=device)
    scales = torch.tensor([INT4_SCALE, -INT4_SCALE], device=device).expand(
        out, in_features // group, 2).contiguous()
    subs = torch.tensor([1, 8], dtype=torch.int16, device=device).expand(
        out, in_features // GROUP, 2).contiguous()
    return GgufBlocks("W4", codes, scales, subs)

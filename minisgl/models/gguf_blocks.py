"""The 4- and 8-bit blocks of a GGUF file's linear weights, as they are in the file
(`--quantization gguf`): Q4_0, Q4_1 and (where the VNNI kernel runs them) Q8_0 tensors become
layers.quant.WeightBlocks under their Hugging Face names. Other tensors (norms, embeddings,
other quant types) come from the converted safetensors folder, dequantized as before.

Block layouts (ggml): Q4_0 = fp16 scale d, 16 bytes of codes, w = (q - 8) * d; Q4_1 = fp16 d,
fp16 min m, 16 bytes, w = q * d + m; byte j holds value j (low nibble) and j + 16 (high).
Q8_0 = fp16 d, 32 int8 values q, w = q * d.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from minisgl.layers.quant import GROUP, LANES, WeightBlocks, vnni_kernels

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
           # a mixture of experts' weights, every expert's stacked in one tensor (models.moe)
           "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
# NOTE: llama.cpp's converter permutes the rows of Llama's q / k projections (rotary halves
# interleaved); transformers, and so our dense weights, undo it. Other architectures: none.
PERMUTED = {"llama": {"attn_q": "num_heads", "attn_k": "num_kv_heads"}}


def hf_name(gguf_name: str) -> str | None:
    """model.layers.{i}.<linear>.weight for a GGUF linear weight; None for anything else."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in LINEARS:
        return None
    return f"model.layers.{parts[1]}.{LINEARS[parts[2]]}.weight"


def decode_blocks(kind: str, raw: np.ndarray, out_features: int, in_features: int
                  ) -> WeightBlocks:
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // GROUP,
                                               BLOCK_BYTES[kind])
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        values = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).to(torch.int16)
        return WeightBlocks((values + 128).to(torch.uint8).reshape(out_features, in_features),
                            scales, torch.zeros_like(scales), bits=8)
    if kind == "Q4_1":
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        zeros, packed = mins + 8 * scales, torch.from_numpy(blocks[..., 4:].copy())
    else:
        zeros, packed = torch.zeros_like(scales), torch.from_numpy(blocks[..., 2:].copy())
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(out_features, in_features)
    return WeightBlocks(codes, scales, zeros)


def unpermute_rows(blocks: WeightBlocks, heads: int) -> WeightBlocks:
    """Undo llama.cpp's q / k row permutation (row order only: blocks run along the input)."""
    rows = blocks.shape[0]
    order = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    # NOTE: HF row r sits at GGUF row order[r] (the converter's permutation, inverted)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows)
    return blocks[inverse]


def read_block_linears(path: Path, heads: dict[str, int], skips: Callable[[str], bool]
                       ) -> tuple[dict[str, WeightBlocks], dict[str, str]]:
    """(the Q4_0 / Q4_1 / Q8_0 linear weights by HF name (a list of one per expert for the
    stacked experts' tensors), {HF name: GGUF type} of the other linear weights, which stay
    dense), leaving out the names `skips` (the model's: layers past a layer-count override). `heads`: num_heads and num_kv_heads. Q8_0 needs the VNNI kernel
    (torch has no kernel for such blocks): without it, those stay dense."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    blocks, dense = {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None or skips(name):
            continue
        kind = tensor.tensor_type.name
        in_features, out_features = (int(n) for n in tensor.shape[:2])
        eight_bit_runs = vnni_kernels() is not None and out_features % LANES == 0
        if kind not in BLOCK_BYTES or (kind == "Q8_0" and not eight_bit_runs):
            dense[name] = kind
            continue
        if len(tensor.shape) == 3:  # [experts, out, in]: one weight per expert
            raw = np.asarray(tensor.data).reshape(int(tensor.shape[2]), -1)
            blocks[name] = [decode_blocks(kind, e, out_features, in_features) for e in raw]
            continue
        weight = decode_blocks(kind, tensor.data, out_features, in_features)
        permuted = PERMUTED.get(arch, {}).get(tensor.name.split(".")[2])
        blocks[name] = unpermute_rows(weight, heads[permuted]) if permuted else weight
    return blocks, dense


def stage_block_linears(model: torch.nn.Module, path: Path, heads: dict[str, int]
                       ) -> tuple[dict[str, WeightBlocks], dict[str, str]]:
    """Prepare every linear layer whose checkpoint tensors are all blocks of one width to take
    them (`expect_blocks`); returns those tensors by HF name, and the GGUF types of the linear
    weights that stay dense (a layer with any of them, or with mixed widths, stays dense
    whole). Any GGUF type loads: the dense ones come dequantized from the converted folder."""
    blocks, dense = read_block_linears(path, heads, model.skips)
    names_by_module: dict[torch.nn.Module, list[str]] = {}
    for name in [*blocks, *dense]:
        names_by_module.setdefault(model.weight_target(name)[0], []).append(name)
    staged, kept = {}, {}
    for module, names in names_by_module.items():
        widths = {_bits(blocks[name]) for name in names if name in blocks}
        if all(name in blocks for name in names) and len(widths) == 1:
            module.expect_blocks(widths.pop())
            staged.update((name, blocks[name]) for name in names)
        else:
            kept.update((name, dense[name] if name in dense else
                         f"{_bits(blocks[name])}-bit blocks beside others") for name in names)
    return staged, kept


def _bits(blocks: WeightBlocks | list[WeightBlocks]) -> int:
    return blocks[0].bits if isinstance(blocks, list) else blocks.bits

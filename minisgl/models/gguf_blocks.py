"""The 4-bit blocks of a GGUF file's linear weights, as they are in the file (`--quantization
gguf`): Q4_0 and Q4_1 tensors become layers.quant.Int4Blocks under their Hugging Face names.
Other tensors (norms, embeddings, other quant types) come from the converted safetensors
folder, dequantized as before.

Block layouts (ggml): Q4_0 = fp16 scale d, 16 bytes of codes, w = (q - 8) * d; Q4_1 = fp16 d,
fp16 min m, 16 bytes, w = q * d + m. Byte j holds value j (low nibble) and j + 16 (high).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from minisgl.layers.quant import GROUP, Int4Blocks

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
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
                  ) -> Int4Blocks:
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // GROUP,
                                               BLOCK_BYTES[kind])
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q4_1":
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        zeros, packed = mins + 8 * scales, torch.from_numpy(blocks[..., 4:].copy())
    else:
        zeros, packed = torch.zeros_like(scales), torch.from_numpy(blocks[..., 2:].copy())
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(out_features, in_features)
    return Int4Blocks(codes, scales, zeros)


def unpermute_rows(blocks: Int4Blocks, heads: int) -> Int4Blocks:
    """Undo llama.cpp's q / k row permutation (row order only: blocks run along the input)."""
    rows = blocks.shape[0]
    order = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    # NOTE: HF row r sits at GGUF row order[r] (the converter's permutation, inverted)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(rows)
    return Int4Blocks(blocks.codes[inverse], blocks.scales[inverse], blocks.zeros[inverse])


def read_int4_linears(path: Path, heads: dict[str, int]) -> tuple[dict[str, Int4Blocks],
                                                                   dict[str, str]]:
    """(the Q4_0 / Q4_1 linear weights by HF name, {HF name: GGUF type} of the other linear
    weights, which stay dense). `heads`: num_heads and num_kv_heads."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    blocks, dense = {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        if kind not in BLOCK_BYTES:
            dense[name] = kind
            continue
        in_features, out_features = (int(n) for n in tensor.shape[:2])
        weight = decode_blocks(kind, tensor.data, out_features, in_features)
        permuted = PERMUTED.get(arch, {}).get(tensor.name.split(".")[2])
        blocks[name] = unpermute_rows(weight, heads[permuted]) if permuted else weight
    return blocks, dense


def stage_int4_linears(model: torch.nn.Module, path: Path, heads: dict[str, int]
                       ) -> tuple[dict[str, Int4Blocks], dict[str, str]]:
    """Prepare every linear layer whose checkpoint tensors are all 4-bit blocks to take them
    (`expect_int4`); returns those tensors by HF name, and the GGUF types of the linear weights
    that stay dense (a layer with any of them stays dense whole)."""
    blocks, dense = read_int4_linears(path, heads)
    names_by_module: dict[torch.nn.Module, list[str]] = {}
    for name in [*blocks, *dense]:
        names_by_module.setdefault(model.weight_target(name)[0], []).append(name)
    staged, kept = {}, {}
    for module, names in names_by_module.items():
        if all(name in blocks for name in names):
            module.expect_int4()
            staged.update((name, blocks[name]) for name in names)
        else:
            kept.update((name, dense.get(name, "Q4")) for name in names)
    return staged, kept

"""The bundled model written as the quantized checkpoints users download, each in its library's
documented layout (AutoAWQ gemm, AutoGPTQ v1, compressed-tensors pack-quantized, block-wise
fp8), beside a dense folder of exactly the weights each encodes: the reference transformers
serves in float32. Test-side: simple round-to-nearest quantizers, valid bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minisgl.models import resolve_model_path

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_rows(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[r, 8 n] codes -> [r, n] int32, code `order[j]` of each 8 at bits 4j."""
    grouped = codes.to(torch.int64).view(codes.shape[0], -1, 8)[..., list(order)]
    words = sum(grouped[..., j] << (4 * j) for j in range(8))
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # as the int32 bits


def int4_groups(weight: torch.Tensor, group: int, symmetric: bool,
                scale_dtype: torch.dtype = torch.float16
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] 0..15, fp16 scales [out, in / g], zero points [out, in / g]);
    `group` -1: one group per row."""
    out, in_features = weight.shape
    group = in_features if group == -1 else group
    g = weight.view(out, in_features // group, group)
    if symmetric:
        scales = (g.abs().amax(-1) / 7.5).clamp_min(1e-8).to(scale_dtype)
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((high - low) / 15).clamp_min(1e-8).to(scale_dtype)
        zeros = (-low / scales.float()).round().clamp(0, 15).long()
    codes = (g / scales.float()[..., None]).round() + zeros[..., None]
    return codes.clamp(0, 15).long().view(out, in_features), scales, zeros


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    group = codes.shape[1] // scales.shape[1]
    return ((codes - zeros.repeat_interleave(group, 1)).float()
            * scales.float().repeat_interleave(group, 1))


def awq_tensors(codes, scales, zeros) -> dict[str, torch.Tensor]:
    return {"qweight": pack_rows(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_rows(zeros.t().contiguous(), AWQ_ORDER),
            "scales": scales.t().contiguous()}


def gptq_tensors(codes, scales, zeros) -> dict[str, torch.Tensor]:
    group = codes.shape[1] // scales.shape[1]
    return {"qweight": pack_rows(codes).t().contiguous(),  # [in / 8, out]
            "qzeros": pack_rows((zeros - 1).t().contiguous()),  # v1: z - 1
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(codes.shape[1]) // group).to(torch.int32)}


def compressed_tensors(codes, scales, zeros, symmetric: bool) -> dict[str, torch.Tensor]:
    tensors = {"weight_packed": pack_rows(codes), "weight_scale": scales,
               "weight_shape": torch.tensor(list(codes.shape))}
    if not symmetric:  # packed along the outputs: [out / 8, in / g]
        tensors["weight_zero_point"] = pack_rows(zeros.t().contiguous()).t().contiguous()
    return tensors


def fp8_block(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(block-wise fp8 tensors, the weight they encode)."""
    out, in_features = weight.shape
    rows, cols = -(-out // 128), -(-in_features // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out, :in_features] = weight
    blocks = padded.view(rows, 128, cols, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    encoded = (q.float() * scale[:, None, :, None]).view(rows * 128, cols * 128)
    return ({"weight": q.view(rows * 128, cols * 128)[:out, :in_features].contiguous(),
             "weight_scale_inv": scale.float()}, encoded[:out, :in_features].contiguous())


CONFIGS = {
    "awq": lambda g, sym: {"quant_method": "awq", "bits": 4, "group_size": g,
                           "zero_point": not sym, "version": "gemm"},
    "gptq": lambda g, sym: {"quant_method": "gptq", "bits": 4, "group_size": g,
                            "desc_act": False, "sym": sym, "checkpoint_format": "gptq"},
    "compressed-tensors": lambda g, sym: {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": sym,
            **({"strategy": "channel"} if g == -1 else {"strategy": "group", "group_size": g})}}},
        "ignore": ["lm_head"]},
    "fp8": lambda g, sym: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]},
}


def write_checkpoint(root: Path, method: str, group: int = 128, symmetric: bool = False
                     ) -> tuple[Path, Path]:
    """(the quantized folder, the dense folder of the weights it encodes) under `root`, of
    the bundled model."""
    quantized, dense = root / f"{method}-g{group}", root / f"{method}-g{group}-dense"
    if not quantized.exists():
        write_quantized(resolve_model_path(None), quantized, dense, method, group, symmetric)
    return quantized, dense


def write_quantized(source: Path, quantized: Path, dense: Path, method: str, group: int,
                    symmetric: bool, linears: tuple[str, ...] = LINEARS) -> None:
    """`source` (one model.safetensors) with its weights named `*{linears}.weight` quantized,
    and beside it the dense folder of the weights that encodes."""
    state = load_file(str(source / "model.safetensors"))
    packed, reference = {}, dict(state)
    for name, weight in state.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(linears):
            packed[name] = weight
            continue
        if method == "fp8":
            tensors, reference[name] = fp8_block(weight)
        else:
            # NOTE: compressed-tensors keeps scales in the model's dtype (bfloat16 here)
            codes, scales, zeros = int4_groups(
                weight, group, symmetric,
                torch.bfloat16 if method == "compressed-tensors" else torch.float16)
            reference[name] = dequantized(codes, scales, zeros)
            tensors = {"awq": awq_tensors, "gptq": gptq_tensors}[method](codes, scales, zeros) \
                if method != "compressed-tensors" else \
                compressed_tensors(codes, scales, zeros, symmetric)
        packed.update((f"{prefix}.{suffix}", t) for suffix, t in tensors.items())
    config = json.loads((source / "config.json").read_text())
    for folder, tensors, extra in ((quantized, packed, {"quantization_config":
                                                        CONFIGS[method](group, symmetric)}),
                                   (dense, reference, {})):
        staging = folder.with_name(folder.name + f".{os.getpid()}")
        staging.mkdir(parents=True)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        for file in source.iterdir():
            if file.name not in ("config.json", "model.safetensors"):
                shutil.copy(file, staging / file.name)
        staging.rename(folder)

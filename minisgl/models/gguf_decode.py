"""A GGUF tensor's blocks as layers.gguf_weight.GgufBlocks: codes and scales read from ggml's
published block layouts, nothing dequantized.

Flat blocks of 32 values (byte j of the 16 nibble bytes: value j low, value j + 16 high):
  Q4_0: fp16 d, 16 bytes; w = d (q - 8)        Q4_1: fp16 d, fp16 m, 16 bytes; w = d q + m
  Q5_0: fp16 d, 4 bytes of high bits (bit j: value j), 16 bytes; w = d (q - 16)
  Q5_1: fp16 d, fp16 m, high bits, 16 bytes; w = d q + m
  Q8_0: fp16 d, 32 int8; w = d q
  MXFP4: e8m0 byte e, 16 bytes; w = 2^(e - 127) E2M1[q] (held as d = 2^(e - 128) times the
        kernel's 2 E2M1[q] + 12, less 12 d: exact where d is a float16, 2^-24 .. 2^15)
Super-blocks of 256 values:
  Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit (sc, mn) for 8 groups of 32, 128 nibble bytes (per
        64 values, 32 bytes: values 0-31 low nibbles, 32-63 high); w = d sc q - dmin mn
  Q5_K: as Q4_K with 32 bytes of high bits after the scales (bit t of byte l: value 32 t + l)
  Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values),
        fp16 d; per 128 values: low byte l / l + 32 (low nibble: values l, l + 32; high: l + 64,
        l + 96), high byte l bits 2u: value l + 32 u; w = d sc (q - 32)
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.layers.gguf_weight import GROUP, KINDS, LUT_OFFSET, SUPER, GgufBlocks

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "MXFP4": 17,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
assert set(BLOCK_BYTES) == set(KINDS) - {"W4"}  # W4: checkpoints (models.hf_quant)


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw.copy().view(np.float16)[..., 0].astype(np.float32))


def _bytes(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw.copy())


def _nibbles(raw: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([raw & 15, raw >> 4], dim=-1)


def _bits(raw: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field t (`width` bits at t * width) of every byte."""
    shifts = torch.arange(count, dtype=torch.uint8).view(count, 1) * width
    return (raw.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def read_gguf_blocks(kind: str, raw: np.ndarray, out_features: int, in_features: int) -> GgufBlocks:
    size = BLOCK_BYTES[kind]
    per_block = SUPER if kind.endswith("_K") else GROUP
    if in_features % per_block:
        raise ValueError(f"{kind} needs input features divisible by {per_block}, "
                         f"got {in_features}")
    b = np.ascontiguousarray(raw).reshape(out_features, in_features // per_block, size)
    return (_decode_super if per_block == SUPER else _decode_flat)(kind, b, out_features,
                                                                  in_features)


def mxfp4_blocks(codes: torch.Tensor, exponents: torch.Tensor) -> GgufBlocks:
    """MXFP4 codes [out, in] (E2M1 indices) and their e8m0 exponents [out, in / 32] as blocks;
    a scale a float16 cannot hold exactly is a ValueError (the weight then stays dense)."""
    power = exponents.to(torch.int32) - 128
    if int(power.min()) < -24 or int(power.max()) > 15:
        raise ValueError("MXFP4 scales outside float16's exact powers of two")
    d = torch.ldexp(torch.ones_like(power, dtype=torch.float32), power)
    return GgufBlocks("MXFP4", codes, torch.stack([d, -LUT_OFFSET * d], -1), None)


def _decode_flat(kind: str, b: np.ndarray, out: int, in_features: int) -> GgufBlocks:
    if kind == "MXFP4":
        return mxfp4_blocks(_nibbles(_bytes(b[..., 1:])).reshape(out, in_features),
                            _bytes(b[..., 0]))
    d = _f16(b[..., 0:2])
    if kind == "Q8_0":
        codes = torch.from_numpy(b[..., 2:].copy().view(np.int8)).reshape(out, in_features)
        return GgufBlocks(kind, codes, torch.stack([d, torch.zeros_like(d)], -1), None)
    with_min = kind in ("Q4_1", "Q5_1")
    m = _f16(b[..., 2:4]) if with_min else None
    at = 4 if with_min else 2
    if kind.startswith("Q5"):
        high = _bits(_bytes(b[..., at:at + 4]), 8).transpose(-1, -2).reshape(*b.shape[:2], 32)
        codes = _nibbles(_bytes(b[..., at + 4:])) | (high << 4)
        center = 16
    else:
        codes, center = _nibbles(_bytes(b[..., at:])), 8
    offsets = m if with_min else -center * d
    return GgufBlocks(kind, codes.reshape(out, in_features), torch.stack([d, offsets], -1), None)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> (sc, mn) [..., 8]: groups 0-3 in the low 6 bits of bytes
    0-3 / 4-7; groups 4-7 low 4 bits in bytes 8-11 (sc low nibble, mn high), top 2 bits in the
    top of bytes 0-3 (sc) / 4-7 (mn)."""
    first, second, last = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = torch.cat([first & 63, (last & 15) | ((first >> 6) << 4)], dim=-1)
    mn = torch.cat([second & 63, (last >> 4) | ((second >> 6) << 4)], dim=-1)
    return sc, mn


def _decode_super(kind: str, b: np.ndarray, out: int, in_features: int) -> GgufBlocks:
    rows, supers = b.shape[:2]
    raw = _bytes(b)
    if kind == "Q6_K":
        low, high = raw[..., 0:128], raw[..., 128:192]
        sc = torch.from_numpy(b[..., 192:208].copy().view(np.int8)).to(torch.int16)
        d = _f16(b[..., 208:210])
        halves = []
        for h in range(2):  # 128 values each
            lo = _nibbles(low[..., 64 * h:64 * h + 64])  # values 0-63 low, 64-127 high nibbles
            hi = _bits(high[..., 32 * h:32 * h + 32], 4, 2).reshape(rows, supers, 128)
            halves.append(lo | (hi << 4))
        codes = torch.cat(halves, dim=-1)
        scales = torch.stack([d, torch.zeros_like(d)], dim=-1)
        subs = sc.view(rows, supers * 8, 2)  # per group of 32: its two halves' scales
    else:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(raw[..., 4:16])
        at = 16
        if kind == "Q5_K":
            high = _bits(raw[..., 16:48], 8).reshape(rows, supers, 256)
            at = 48
        lows = raw[..., at:at + 128].reshape(rows, supers, 4, 32)
        codes = _nibbles(lows).reshape(rows, supers, 256)
        if kind == "Q5_K":
            codes = codes | (high << 4)
        scales = torch.stack([d, -dmin], dim=-1)
        subs = torch.stack([sc, mn], dim=-1).to(torch.int16).view(rows, supers * 8, 2)
    return GgufBlocks(kind, codes.reshape(out, in_features).to(torch.uint8), scales, subs)

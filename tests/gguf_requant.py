"""Copies of the bundled GGUF (its metadata and tokenizer) with tensors re-encoded in other GGUF
types: real files in layouts the bundled one does not have, for the loaders. Each is written
once into the cache folder (a stable file, so its converted safetensors folder is cached too).

`requant_gguf` takes a type per tensor and may cut the model to its first layers (small files
that convert fast); the gguf package quantizes what it can, and the k-quants it cannot
(Q4_K, Q6_K) are encoded here, simply but validly (the reference is gguf's own dequantize of
the bytes, which transformers' GGUF reader uses too).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from minisgl.env import cache_root
from minisgl.models.weights import bundled_gguf

Kind = GGMLQuantizationType
QK_K = 256  # values per k-quant super-block


def requant_gguf(tag: str, kind_of: Callable[[str, Kind], Kind | None],
                 layers: int | None = None) -> Path:
    """The bundled GGUF with each tensor in `kind_of(name, its type)` (None: as it is), and
    with `layers`, only blk.0 .. blk.{layers - 1} (block_count set to match). `tag` names the
    file: one tag, one content."""
    path = cache_root() / "test-models" / f"SmolLM2-135M-Instruct.{tag}.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = GGUFReader(str(bundled_gguf()))
    arch = source.fields["general.architecture"].contents()
    partial = path.with_suffix(f".{os.getpid()}.partial")
    writer = GGUFWriter(str(partial), arch)
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind, value = field.types[0], field.contents()
        if key == f"{arch}.block_count" and layers is not None:
            value = layers
        writer.add_key_value(key, value, kind,
                             sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)
    for tensor in source.tensors:
        parts = tensor.name.split(".")
        if layers is not None and parts[0] == "blk" and int(parts[1]) >= layers:
            continue
        data, kind = tensor.data, tensor.tensor_type
        target = kind_of(tensor.name, kind)
        if target is not None and target != kind:
            data, kind = encode(quants.dequantize(data, kind), target), target
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def q8_0_gguf() -> Path:
    """The whole bundled model with its Q4_1 linear weights re-encoded as Q8_0."""
    return requant_gguf("Q8_0", lambda name, kind: Kind.Q8_0 if name.startswith("blk.")
                        and kind == Kind.Q4_1 else None)


def encode(weights: np.ndarray, kind: Kind) -> np.ndarray:
    """float32 rows -> `kind`'s bytes (or values, for F32 / F16)."""
    if kind in K_ENCODERS:
        rows = weights.reshape(-1, QK_K).astype(np.float32)
        return K_ENCODERS[kind](rows).reshape(*weights.shape[:-1], -1)
    return quants.quantize(weights, kind)


def fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def inverse(x: np.ndarray) -> np.ndarray:
    """1 / x, and 0 where x is 0 (a block of zeros)."""
    return np.divide(1.0, x, out=np.zeros_like(x), where=x > 0)


def as_fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def encode_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K: per 256 values fp16 d and dmin, 8 sub-blocks of 32 with a 6-bit scale sc and min
    m (packed in 12 bytes), 4-bit codes q: w = d * sc * q - dmin * m."""
    n = rows.shape[0]
    sub = rows.reshape(n, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0)  # m >= 0: the offset can only lower a sub-block
    step_needed = (sub.max(axis=-1) - low) / 15
    d = as_fp16(step_needed.max(axis=-1, keepdims=True) / 63)
    dmin = as_fp16(-low.min(axis=-1, keepdims=True) / 63)
    sc = np.clip(np.ceil(step_needed * inverse(d)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low * inverse(dmin)), 0, 63).astype(np.uint8)
    q = np.round((sub + (dmin * m)[..., None]) * inverse(d * sc)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)  # byte i of run c: 2c, 2c + 1
    four = np.uint8(4)
    packed_scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> four) << np.uint8(6)),
                                    m[:, :4] | ((m[:, 4:] >> four) << np.uint8(6)),
                                    (sc[:, 4:] & np.uint8(15)) | (m[:, 4:] << four)], axis=-1)
    codes = (q[:, :, 0] | (q[:, :, 1] << four)).reshape(n, 128)
    return np.concatenate([fp16_bytes(d), fp16_bytes(dmin), packed_scales, codes], axis=-1)


def encode_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K: per 256 values 16 sub-blocks of 16 with an int8 scale, fp16 d, 6-bit codes q
    (low 4 bits in ql, high 2 in qh): w = d * scale * (q - 32)."""
    n = rows.shape[0]
    sub = rows.reshape(n, 16, 16)
    step_needed = np.abs(sub).max(axis=-1) / 31
    d = as_fp16(step_needed.max(axis=-1, keepdims=True) / 127)
    scales = np.clip(np.ceil(step_needed * inverse(d)), 0, 127).astype(np.int8)
    q = np.round(sub * inverse(d * scales)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)  # value 128 h + 32 t + j
    four = np.uint8(4)
    # ql byte (h, i): low nibble value 128 h + i, high nibble value 128 h + 64 + i
    ql = np.concatenate([q[:, :, 0], q[:, :, 1]], axis=-1) & np.uint8(15) | \
        (np.concatenate([q[:, :, 2], q[:, :, 3]], axis=-1) << four)
    # qh byte (h, j): bits 2t, 2t + 1 hold the top two bits of value 128 h + 32 t + j
    qh = sum((q[:, :, t] >> four) << np.uint8(2 * t) for t in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), scales.view(np.uint8),
                           fp16_bytes(d)], axis=-1)


K_ENCODERS: dict[Kind, Callable[[np.ndarray], np.ndarray]] = {
    Kind.Q4_K: encode_q4_k, Kind.Q6_K: encode_q6_k}

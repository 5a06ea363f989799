"""The bundled GGUF with its linear weights re-encoded as Q8_0 (the same weights, 8-bit
blocks): a second real GGUF layout for `--quantization gguf`, written once into the cache
folder (a stable file, so its converted safetensors folder is cached too)."""

from __future__ import annotations

from pathlib import Path

from minisgl.env import cache_root
from minisgl.models.weights import bundled_gguf


def q8_0_gguf() -> Path:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    path = cache_root() / "test-models" / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    source = GGUFReader(str(bundled_gguf()))
    arch = source.fields["general.architecture"].contents()
    partial = path.with_suffix(".partial")
    writer = GGUFWriter(str(partial), arch)
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind,
                             sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)
    for tensor in source.tensors:
        data, kind = tensor.data, tensor.tensor_type
        if tensor.name.startswith("blk.") and kind == GGMLQuantizationType.Q4_1:
            data = quants.quantize(quants.dequantize(data, kind), GGMLQuantizationType.Q8_0)
            kind = GGMLQuantizationType.Q8_0
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path

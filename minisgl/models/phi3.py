"""Phi-3 / Phi-4-mini: the Llama decoder, with checkpoints that store q/k/v as one `qkv_proj`
tensor and gate/up as one `gate_up_proj` tensor. Each fused tensor is split into the parts our
merged layers load (and shard across ranks) one by one."""

from __future__ import annotations

from typing import Any

from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM


class RowRange:
    """Rows [offset, offset + length) of a checkpoint tensor, itself a source that a loader
    slices by rows (`src[a:b]`), read lazily as the tensor is."""

    def __init__(self, source: Any, offset: int, length: int) -> None:
        self.source, self.offset, self.length = source, offset, length

    def __getitem__(self, rows: slice) -> Any:
        start, stop, _ = rows.indices(self.length)
        return self.source[self.offset + start:self.offset + stop]


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        # fused checkpoint tensor -> its parts: (the unfused name, first row, rows)
        self.fused_parts = {
            "qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
            "gate_up_proj": [("gate_proj", 0, arch.intermediate_size),
                             ("up_proj", arch.intermediate_size, arch.intermediate_size)],
        }

    def load_weight(self, name: str, source: Any) -> bool:
        prefix, _, rest = name.rpartition(".")[0].rpartition(".")
        parts = self.fused_parts.get(rest)
        if parts is None or self.skips(name):
            return super().load_weight(name, source)
        param = name.rpartition(".")[2]
        return all(super(Phi3ForCausalLM, self).load_weight(
            f"{prefix}.{part}.{param}", RowRange(source, offset, rows))
            for part, offset, rows in parts)

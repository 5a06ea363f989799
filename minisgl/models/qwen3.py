"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on queries and keys before RoPE."""

import dataclasses

from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(dataclasses.replace(arch, qk_norm=True))

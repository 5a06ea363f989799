"""Qwen2: the Llama decoder with a bias on the q/k/v projections."""

import dataclasses

from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(dataclasses.replace(arch, attention_bias=True))

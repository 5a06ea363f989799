"""Which of our model classes serves a Hugging Face `architectures` entry. Qwen2 and Qwen3 are
the Llama decoder with the traits ModelArch gives them (models.arch.FAMILY_TRAITS)."""

from __future__ import annotations

from torch import nn

from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnsupportedModel(ValueError):
    pass


def build_model(arch: ModelArch) -> nn.Module:
    cls = MODEL_CLASSES.get(arch.architecture)
    if cls is None:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise UnsupportedModel(
            f"unsupported architecture {arch.architecture or '(none given)'!r}; "
            f"supported: {supported}")
    return cls(arch)

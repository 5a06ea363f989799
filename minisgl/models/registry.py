"""Which of our model classes serves a Hugging Face `architectures` entry."""

from __future__ import annotations

from torch import nn

from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen2 import Qwen2ForCausalLM
from minisgl.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
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

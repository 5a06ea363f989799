"""Which of our model classes serves a Hugging Face `architectures` entry. Qwen2 and Qwen3 are
the Llama decoder with the traits ModelArch gives them (models.arch.FAMILY_TRAITS); Qwen3-MoE
and Mixtral are it with experts in place of the MLP (models.moe)."""

from __future__ import annotations

from torch import nn

from minisgl.models.arch import ModelArch
from minisgl.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from minisgl.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from minisgl.models.gemma4 import Gemma4ForCausalLM
from minisgl.models.gpt_oss import GptOssForCausalLM
from minisgl.models.granite_hybrid import GraniteMoeHybridForCausalLM
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.moe import MoEForCausalLM
from minisgl.models.nemotron_h import NemotronHForCausalLM
from minisgl.models.phi3 import Phi3ForCausalLM
from minisgl.models.qwen3_5_vision import Qwen3_5ForCausalLM
from minisgl.models.qwen3_next import Qwen3NextForCausalLM
from minisgl.models.qwen3_vl import Qwen3VLForCausalLM
from minisgl.models.qwen2_5_vl import Qwen2_5_VLForCausalLM
from minisgl.models.smollm3 import SmolLM3ForCausalLM
from minisgl.models.smolvlm import SmolVLMForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2_5_VLForCausalLM": Qwen2_5_VLForCausalLM,
    "SmolVLMForCausalLM": SmolVLMForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3VLForCausalLM": Qwen3VLForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


class UnsupportedModel(ValueError):
    pass


def check_supported(arch: ModelArch) -> None:
    """Raises UnsupportedModel for an architecture we do not serve, or for a config value that
    changes the math and that our decoder does not compute."""
    if arch.architecture not in MODEL_CLASSES:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise UnsupportedModel(
            f"unsupported architecture {arch.architecture or '(none given)'!r}; "
            f"supported: {supported}")
    if arch.uncomputed:
        raise UnsupportedModel(
            f"{arch.architecture}: the config's {', '.join(arch.uncomputed)} changes the "
            "model's math, and minisgl's decoder does not compute it")


def build_model(arch: ModelArch) -> nn.Module:
    check_supported(arch)
    return MODEL_CLASSES[arch.architecture](arch)

"""A Qwen2.5-VL checkpoint (`Qwen2_5_VLForConditionalGeneration`) served as its text model, a
Qwen2 decoder: models.weights reads its `text_config` (or the older flat config), and its
vision tensors are not loaded yet (models.qwen2_5_vision is the encoder; requests with images
are refused). Its multimodal RoPE gives a text token the same position in each of its
sections, so for text alone it is the plain RoPE."""

from __future__ import annotations

from typing import Any

from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weights import text_model_name

VISION_PREFIXES = ("visual.", "model.visual.")


class Qwen2_5_VLForCausalLM(LlamaForCausalLM):
    def load_weight(self, name: str, source: Any) -> bool:
        if name.startswith(VISION_PREFIXES):
            return True
        return super().load_weight(text_model_name(name), source)

"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): a Qwen3 decoder (q/k norms) with multimodal
RoPE, its sections interleaved, and Qwen3-VL's vision encoder (models.qwen3_5_vision) with
"deepstack": besides the embeddings that replace an image's placeholders, the encoder's
features from a few of its blocks are added to the image tokens' hidden states after the
decoder's first layers, one block's features per layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM, with_image_embeddings
from minisgl.models.qwen2_5_vl import QwenVision
from minisgl.models.qwen3_5_vision import Qwen3_5VisionEncoder, Qwen3_5VisionShape
from minisgl.models.weights import text_model_name

DEFAULT_SECTIONS = [24, 20, 20]  # transformers' default for a config that leaves it out


class Qwen3VLForCausalLM(QwenVision, LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        vision = arch.config.get("vision_config")
        self.visual = (Qwen3_5VisionEncoder(Qwen3_5VisionShape.from_config(vision))
                       if vision is not None else None)

    def decoder_layers(self, arch: ModelArch) -> Any:
        """Its multimodal RoPE interleaves its sections whatever the config says."""
        rope = {**arch.rope, "mrope_section": arch.rope.get("mrope_section", DEFAULT_SECTIONS),
                "mrope_interleaved": True}
        return super().decoder_layers(dataclasses.replace(arch, rope=rope))

    @property
    def image_width(self) -> int:
        """An image token's spliced values: its embedding, then one row per deepstack layer."""
        deep = len(self.visual.shape.deep_blocks) if self.visual is not None else 0
        return self.arch.hidden_size * (1 + deep)

    def load_weight(self, name: str, source: Any) -> bool:
        return self.load_vision(name, source) or super().load_weight(text_model_name(name),
                                                                       source)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                      backend: AttentionBackend, rows: torch.Tensor | None) -> torch.Tensor:
        x, residual = with_image_embeddings(self.embed(input_ids), batch), None
        deep: tuple[torch.Tensor, ...] = ()
        if batch.input_embeds is not None:
            image_rows, values = batch.input_embeds
            deep = values[:, self.arch.hidden_size:].split(self.arch.hidden_size, dim=1)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, batch, backend)
            if i < len(deep):  # NOTE: x + residual is the hidden state
                x[image_rows] += deep[i]
        x, _ = self.norm(x, residual)
        return x if rows is None else x.index_select(0, rows)

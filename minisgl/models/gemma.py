"""Gemma 2 and Gemma 3 (text): the Llama decoder's parts arranged as Gemma arranges them.

- Embeddings are scaled by sqrt(hidden_size); the head is tied.
- Every norm multiplies by (1 + w): the checkpoint's w is loaded plus one, so our RMSNorm runs
  unchanged. Queries and keys are normed per head (qk_norm).
- A layer norms its attention output and its MLP output before each residual add (four norms).
- The MLP is GeGLU (gelu, tanh approximation). Queries are scaled by query_pre_attn_scalar^-1/2.
- Sliding-window layers use the local RoPE (`rope_local_base_freq`, default scaling), full ones
  the global RoPE (`rope_theta` with `rope_scaling`); transformers 5 writes both under
  `rope_parameters`, keyed by layer type.

Gemma 2 is Gemma 3 without the q/k norms, with one RoPE for every layer, and with soft-capped
attention scores and logits (ModelArch's attn_logit_softcap / final_logit_softcap, applied by
the attention backend and the LM head); its Hub configs alternate sliding and full layers
without saying so (models.arch.layer_windows).

A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`, 4B and larger): models.weights
reads its `text_config` and keeps its `vision_config`; its images are models.gemma3_vision's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.layers import GeluTanhAndMul, Layer, RMSNorm, RotaryEmbedding
from minisgl.layers.shard import copy_into, read_all
from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import checkpoint_shapes
from minisgl.models.gemma3_vision import Gemma3Images, Gemma3Vision
from minisgl.models.llama import MLP, Attention, LlamaForCausalLM
from minisgl.models.weights import text_model_name


# a multimodal checkpoint's vision side (its text model's: models.weights.text_model_name)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def layer_ropes(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The RoPE of each layer type ("full_attention", "sliding_attention"), from either
    spelling of the config."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        return {kind: dict(rope) for kind, rope in params.items()}
    full = dict(params or config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    return {"full_attention": full, "sliding_attention": local}


class Gemma3DecoderLayer(Layer):
    def __init__(self, arch: ModelArch, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_id, rotary)
        scalar = arch.config.get("query_pre_attn_scalar") or arch.head_dim
        self.self_attn.query_scale = (arch.head_dim / scalar) ** 0.5
        self.mlp = MLP(arch, GeluTanhAndMul())
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x, _ = self.post_attention_layernorm(self.self_attn(x, positions, batch, backend))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        x, _ = self.post_feedforward_layernorm(self.mlp(x))
        return x, residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        self.vision = (Gemma3Vision(arch.config, arch.hidden_size)
                       if arch.config.get("vision_config") is not None else None)
        self.vision_loaded = False  # a GGUF file, for one, holds no vision tensors

    def layer_ropes(self, arch: ModelArch) -> dict[str, dict[str, Any]]:
        return layer_ropes(arch.config)

    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        ropes = {kind: RotaryEmbedding(arch.head_dim, arch.rope_positions, rope, arch.rotary_dim)
                 for kind, rope in self.layer_ropes(arch).items()}
        windows = arch.layer_windows or (0,) * arch.num_layers
        return nn.ModuleList(
            Gemma3DecoderLayer(arch, i, ropes["sliding_attention" if windows[i]
                                              else "full_attention"])
            for i in range(arch.num_layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)

    def load_weight(self, name: str, source: Any) -> bool:
        if name.startswith(VISION_PREFIXES):
            local = name.removeprefix("model.")
            if local.startswith("vision_tower.") and ".vision_model." not in f".{local}":
                local = "vision_tower.vision_model." + local.removeprefix("vision_tower.")
            if self.vision is not None and ".head." not in local:  # SigLIP's unused pooling head
                copy_into(self.vision.get_parameter(local).data, read_all(source), name)
                self.vision_loaded = True
            return True
        name = text_model_name(name)
        if name.endswith("norm.weight") and not self.skips(name):
            source = read_all(source).float() + 1.0  # (1 + w), see the module's docstring
        return super().load_weight(name, source)


    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """--load-format dummy: the text model's tensors and the vision tower's."""
        shapes = checkpoint_shapes(self.arch)
        if self.vision is not None:
            shapes.update({f"model.{name}": tuple(param.shape)
                           for name, param in self.vision.named_parameters()})
        return shapes

    def encode_images(self, pixels: list[torch.Tensor], grids: list[Any]) -> torch.Tensor:
        """[images x tokens, hidden]: the images' embeddings, one after another."""
        assert self.vision is not None
        weight = self.vision.multi_modal_projector.mm_input_projection_weight
        return self.vision.encode(torch.cat(pixels).to(weight.device, weight.dtype)).flatten(0, 1)

    def image_processor(self, folder: Path) -> Gemma3Images | None:
        if self.vision is None or not self.vision_loaded:
            return None
        return Gemma3Images(folder, self.vision, self.arch.config)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    def layer_ropes(self, arch: ModelArch) -> dict[str, dict[str, Any]]:
        return {"full_attention": arch.rope, "sliding_attention": arch.rope}

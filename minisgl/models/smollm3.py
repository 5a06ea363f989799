"""SmolLM3 (SmolLM3ForCausalLM): the Llama decoder whose layers marked 0 in `no_rope_layers`
(by default every `no_rope_layer_interval`-th, the fourth) attend without RoPE (NoPE)."""

from __future__ import annotations

from torch import nn

from minisgl.layers import NoRotary, RotaryEmbedding
from minisgl.models.arch import ModelArch
from minisgl.models.llama import DecoderLayer, LlamaForCausalLM


def rope_layers(config: dict, layers: int) -> list[bool]:
    """Per layer whether its attention rotates queries and keys (transformers' default
    pattern where the config has no list)."""
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval") or 4
        return [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) < layers:
        raise ValueError(f"SmolLM3: no_rope_layers has {len(flags)} entries for {layers} "
                         "layers")
    return [bool(flag) for flag in flags[:layers]]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        rotary = RotaryEmbedding(arch.head_dim, arch.rope_positions, arch.rope, arch.rotary_dim)
        nope = NoRotary()
        return nn.ModuleList(
            DecoderLayer(arch, i, rotary if rope else nope, self.layer_mlp(arch, i))
            for i, rope in enumerate(rope_layers(arch.config, arch.num_layers)))

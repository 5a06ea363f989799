"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral. The Llama decoder (Qwen3-MoE with its
q/k norms, ModelArch) whose MLP is a routed set of experts (layers.moe) in the layers the
config makes sparse (ModelArch.moe).

Checkpoint names, all loaded: per expert `mlp.experts.N.{gate,up,down}_proj` (Qwen3-MoE) or
`block_sparse_moe.experts.N.{w1,w3,w2}` (Mixtral, router `block_sparse_moe.gate`), and the
stacked `mlp.experts.gate_up_proj` / `down_proj` tensors of transformers 5's modelling.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from minisgl.layers.moe import SparseMoE
from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM

EXPERT_TENSOR = re.compile(
    r"^(?P<experts>.*\.mlp\.experts)\.(?:(?P<expert>\d+)\.)?"
    r"(?P<part>gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?$")
MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                 ".w2.": ".down_proj."}


def our_name(name: str) -> str:
    """Mixtral's checkpoint names in Qwen3-MoE's spelling."""
    if ".block_sparse_moe." in name:
        for mixtral, ours in MIXTRAL_NAMES.items():
            name = name.replace(mixtral, ours)
    return name


class MoEForCausalLM(LlamaForCausalLM):
    # PEFT adapters name Mixtral's experts' projections as its checkpoint does
    lora_target_aliases = {mixtral.strip("."): ours.strip(".") for mixtral, ours
                           in MIXTRAL_NAMES.items() if mixtral.startswith(".w")}

    def layer_mlp(self, arch: ModelArch, layer_id: int) -> SparseMoE | None:
        moe = arch.moe
        assert moe is not None
        if layer_id not in moe.sparse_layers:
            return None
        return SparseMoE(arch.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                         moe.renormalize)

    def weight_target(self, name: str) -> tuple[nn.Module, str, Any] | None:
        name = our_name(name)
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return super().weight_target(name)
        try:
            experts = self.get_submodule(match["experts"].removeprefix("model."))
        except AttributeError:
            return None
        expert = None if match["expert"] is None else int(match["expert"])
        return experts, match["part"].removesuffix("_proj"), expert

    def load_weight(self, name: str, source: Any) -> bool:
        name = our_name(name)
        if EXPERT_TENSOR.match(name) is None or self.skips(name):
            return super().load_weight(name, source)
        target = self.weight_target(name)
        if target is None:
            return False
        experts, part, expert = target
        experts.load(expert, part, source)
        return True

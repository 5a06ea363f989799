"""LoRA adapters in PEFT's layout: a folder with `adapter_config.json` and
`adapter_model.safetensors` (or `.bin`), tensors named `base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r]. Read into host tensors with the scaling (alpha / r, or
alpha / sqrt(r) with rsLoRA; per module with rank_pattern / alpha_pattern) folded into B.
What changes the output in a way minisgl does not compute is refused, naming the setting.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PREFIX = "base_model.model."
# config keys whose non-default values need what minisgl does not compute
REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "use_qalora": "QA-LoRA (use_qalora)",
}


# a LoRA on transformers 5's stacked expert parameters: `<...>.experts(.base_layer)*`
EXPERT_STACK = re.compile(r"(?P<experts>.+\.experts)(?P<nesting>(?:\.base_layer)*)")
# the stacked expert parameters and the checkpoint projections each stands for
FUSED_EXPERT_TARGETS = {"gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}


class AdapterError(ValueError):
    """An adapter folder minisgl cannot serve; the message says why."""


@dataclass
class PeftAdapter:
    path: str
    rank: int  # the largest of its modules
    targets: set[str]  # module leaf names it adapts (q_proj, ...)
    # "model.layers.0.self_attn.q_proj" -> (A [r, in], B scaled [out, r]), float32, host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # LoRA on stacked expert parameters, as read (split_expert_stack)
    expert_stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # adapter_config.json


def read_adapter(path: str | Path) -> PeftAdapter:
    """Raises AdapterError (a missing folder, an unsupported setting, a malformed file)."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter folder (no adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{config_file}: not JSON ({exc})") from None
    _check_config(config, str(path))
    tensors = _read_tensors(folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight", name.removeprefix(PREFIX))
        if match is None:
            what = ("LoRA on the token embedding or the LM head" if "embed" in name
                    or "lm_head" in name else f"tensor {name}")
            raise AdapterError(f"{path}: {what} is not supported; minisgl adapts the "
                               "decoder's linear layers only (lora_A / lora_B)")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    weights, stacks, rank, targets = {}, {}, 0, set()
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{'A' if 'B' in pair else 'B'} "
                               "missing")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} do not make a rank-r product")
        stack = EXPERT_STACK.fullmatch(module)
        if stack is None:
            weights[module] = (a.float(), b.float() * _scaling(config, module, a.shape[0]))
            rank = max(rank, a.shape[0])
            targets.add(module.rpartition(".")[2])
            continue
        stacks[module] = (a, b)
        for parameter in _stacked_parameters(config, str(path)):
            r = _pattern_value(config.get("rank_pattern") or {}, f"{stack['experts']}."
                               f"{parameter}", config.get("r", 8))
            # NOTE: a fused gate_up adapter stands for gate's and up's, each of half its rank
            rank = max(rank, -(-r // 2) if parameter == "gate_up_proj" else r)
            targets.update(FUSED_EXPERT_TARGETS[parameter])
    if not weights and not stacks:
        raise AdapterError(f"{path}: the adapter has no LoRA weights")
    return PeftAdapter(str(path), rank, targets, weights, stacks, config)


def _stacked_parameters(config: dict[str, Any], path: str) -> list[str]:
    listed = [t.rpartition(".")[2] for t in config.get("target_parameters") or []]
    if not listed or set(listed) - FUSED_EXPERT_TARGETS.keys():
        raise AdapterError(f"{path}: LoRA on the parameters {listed} is not supported; "
                           "minisgl adapts the experts' gate_up_proj and down_proj")
    return listed


def split_expert_stack(adapter: PeftAdapter, module: str, parameter: str, experts: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA on one stacked expert parameter (PEFT's ParamWrapper, as `target_parameters` or
    transformers 5's fused experts make it; `module`: its `<experts>(.base_layer)*` name,
    `parameter`: gate_up_proj or down_proj, which the caller tells by shape) as each expert's
    (A, B scaled): A [r * E, in] holds expert e's rows at e * r.., B [out, r * E] its columns
    at e, e + E, ..."""
    a, b = adapter.expert_stacks[module]
    name = f"{EXPERT_STACK.fullmatch(module)['experts']}.{parameter}"
    config = adapter.config
    r = _pattern_value(config.get("rank_pattern") or {}, name, config.get("r", 8))
    if a.shape[0] != r * experts:
        raise AdapterError(f"{adapter.path}: {name}: lora_A has {a.shape[0]} rows, not rank "
                           f"{r} for each of the model's {experts} experts (factors shared "
                           "across experts are not supported)")
    scaling = _scaling(config, name, r)
    a_per, b_per = a.float().view(experts, r, -1), b.float().view(b.shape[0], r, experts)
    return [(a_per[e], b_per[:, :, e] * scaling) for e in range(experts)]


def _check_config(config: dict[str, Any], path: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')} is not supported "
                           "(LORA only)")
    for key, what in REFUSED.items():
        if config.get(key) not in (None, False, [], {}):
            raise AdapterError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases (bias={config['bias']!r}) are not supported")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file
            return load_file(str(safetensors_file))
        if bin_file.is_file():
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"{folder}: cannot read the adapter weights ({exc})") from None
    raise AdapterError(f"{folder}: no adapter_model.safetensors or adapter_model.bin")


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module,
                           config.get("lora_alpha", 8))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank/alpha patterns: a key matches a module whose name ends with it (at a dot)."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default

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
from dataclasses import dataclass
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


class AdapterError(ValueError):
    """An adapter folder minisgl cannot serve; the message says why."""


@dataclass
class PeftAdapter:
    path: str
    rank: int  # the largest of its modules
    targets: set[str]  # module leaf names it adapts (q_proj, ...)
    # "model.layers.0.self_attn.q_proj" -> (A [r, in], B scaled [out, r]), float32, host
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


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
    weights, rank = {}, 0
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{'A' if 'B' in pair else 'B'} "
                               "missing")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterError(f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} do not make a rank-r product")
        weights[module] = (a.float(), b.float() * _scaling(config, module, r))
        rank = max(rank, r)
    if not weights:
        raise AdapterError(f"{path}: the adapter has no LoRA weights")
    return PeftAdapter(str(path), rank, {m.rpartition(".")[2] for m in weights}, weights)


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

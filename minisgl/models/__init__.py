"""Model definitions (our own code, not transformers' modeling classes) and weight loading."""

from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import load_dummy
from minisgl.models.loader import load_weights, log_weight_memory
from minisgl.models.registry import UnsupportedModel, build_model, check_supported
from minisgl.models.weights import (
    ModelNotFound,
    generation_defaults,
    generation_eos_ids,
    load_config,
    load_safetensors,
    model_name,
    resolve_model_path,
)

__all__ = ["ModelArch", "ModelNotFound", "UnsupportedModel", "build_model", "check_supported",
           "generation_defaults", "generation_eos_ids", "load_config",
           "load_dummy", "load_safetensors", "load_weights", "log_weight_memory", "model_name",
           "resolve_model_path"]

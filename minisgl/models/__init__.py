"""Model definitions (our own code, not transformers' modeling classes) and weight loading."""

from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import load_dummy
from minisgl.models.registry import UnsupportedModel, build_model
from minisgl.models.weights import (
    ModelNotFound,
    load_config,
    load_safetensors,
    resolve_model_path,
)

__all__ = ["ModelArch", "ModelNotFound", "UnsupportedModel", "build_model", "load_config",
           "load_dummy", "load_safetensors", "resolve_model_path"]

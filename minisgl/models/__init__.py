"""Model definitions (our own code, not transformers' modeling classes) and weight loading."""

from minisgl.models.arch import ModelArch
from minisgl.models.registry import UnsupportedModel, build_model
from minisgl.models.weights import ModelNotFound, init_dummy, load_config, load_safetensors, resolve_model_path

__all__ = ["ModelArch", "ModelNotFound", "UnsupportedModel", "build_model", "init_dummy",
           "load_config", "load_safetensors", "resolve_model_path"]

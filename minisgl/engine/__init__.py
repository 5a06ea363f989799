"""The engine: model + device memory + one forward, run on an engine stream."""

from minisgl.engine.engine import Engine, ForwardInput, ForwardOutput

__all__ = ["Engine", "ForwardInput", "ForwardOutput"]

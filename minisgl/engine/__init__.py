"""The engine: model + device memory + one forward, run on an engine stream."""

from minisgl.engine.engine import Engine, EngineFailed, ForwardInput, ForwardOutput, HostInputs

__all__ = ["Engine", "EngineFailed", "ForwardInput", "ForwardOutput", "HostInputs"]

"""The engine: model + device memory + one forward, run on an engine stream."""

from minisgl.engine.engine import (Engine, EngineFailed, ForwardInput, ForwardOutput, HostInputs,
                                   InputLogprobRows)
from minisgl.engine.stream import no_openmp_on_this_thread

__all__ = ["Engine", "EngineFailed", "ForwardInput", "ForwardOutput", "HostInputs",
           "InputLogprobRows", "no_openmp_on_this_thread"]

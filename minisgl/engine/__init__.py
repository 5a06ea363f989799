"""The engine: model + device memory + one forward, run on an engine stream."""

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.forward import (ForwardInput, ForwardOutput, GrammarMask, InputLogprobRows,
                                    VerifyRows)
from minisgl.engine.tp_message import StepMessage

__all__ = ["Engine", "EngineConfig", "ForwardInput", "ForwardOutput", "GrammarMask",
           "InputLogprobRows", "StepMessage", "VerifyRows"]

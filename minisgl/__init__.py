"""minisgl: an LLM inference server in one asyncio process, with SGLang-grade scheduling."""

from minisgl.core import SamplingParams
from minisgl.version import __version__
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # `from minisgl import LLM` without importing torch eagerly
    if name == "LLM":
        from minisgl.llm import LLM
        return LLM
    raise AttributeError(name)

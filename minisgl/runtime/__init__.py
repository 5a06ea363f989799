"""Between the front ends and the scheduler: the runtime that builds everything, the request
manager with its tokenizer and detokenizer, and the metrics."""

from minisgl.runtime.manager import ChatPrompt, Prompt, ReqHandle, RequestManager
from minisgl.runtime.runtime import Runtime

__all__ = ["ChatPrompt", "Prompt", "ReqHandle", "RequestManager", "Runtime"]

"""The offline API: `LLM(...).generate(...)`, driving the same scheduler as the server."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from minisgl.args import ServerArgs
from minisgl.core import SamplingParams
from minisgl.env import no_openmp_on_this_thread
from minisgl.errors import InvalidRequest
from minisgl.protocol.embeddings import (EMBEDDING_ONLY, EmbeddingRequest, EmbeddingShape, embed,
                                         encode_results, parse_encode)
from minisgl.protocol.native import KNOWN_FIELDS, GenerateRequest, generate_results, parse_generate
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import Runtime


class LLM:
    """`LLM(model=None, dtype="auto", **server_args)`; `model=None` is the bundled SmolLM2.

    `shutdown()` stops it (also `with LLM(...) as llm:`); one still running when the
    interpreter exits is shut down then, quietly."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **server_args: Any) -> None:
        # NOTE: offline, image_data may name any local file
        server_args.setdefault("allowed_local_media_path", "/")
        self.args = ServerArgs(model_path=model, dtype=dtype, **server_args)
        self.runtime = Runtime(self.args)
        self._loop = asyncio.new_event_loop()
        # NOTE: the finalizer holds the loop and the runtime, never self, so an LLM that is
        # dropped is shut down by the garbage collector, and one still alive at exit by atexit.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self.runtime)
        _run(self._loop, self.runtime.start())
        self._tokens = TokenTexts(self.runtime.tokenizer)  # logprob entries' texts, cached

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer.hf if self.runtime.tokenizer else None

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | SamplingParams | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool | list[bool] = False,
                 top_logprobs_num: int | list[int] = 0,
                 logprob_start_len: int | list[int] = -1,
                 **fields: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `/generate` offline, with the same names (`prompt` is `text`) and the same
        answer: one dict for one prompt, else a list (prompt i's n samples in a row). Other
        `/generate` fields (`rid`, `return_text_in_logprobs`, `return_prompt_token_ids`, ...)
        are keyword arguments; `stream` is not offered here. The batch is validated whole
        before anything runs."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        unknown = sorted(set(fields) - KNOWN_FIELDS - {"text"})
        if unknown:
            raise TypeError(f"LLM.generate() got unexpected keyword argument(s) {unknown}")
        if fields.get("stream"):
            raise InvalidRequest("stream is not supported by LLM.generate")
        # NOTE: the arguments are /generate's fields, checked by the same parser; SamplingParams
        # objects are taken as they are (parse_generate validates a copy)
        req = parse_generate({"text": prompt, **fields, "input_ids": input_ids,
                              "sampling_params": sampling_params,
                              "return_logprob": return_logprob,
                              "top_logprobs_num": top_logprobs_num,
                              "logprob_start_len": logprob_start_len},
                             self.runtime.requests.max_sequences)
        return _run(self._loop, self._generate(req))

    async def _generate(self, req: GenerateRequest) -> Any:
        requests = self.runtime.requests
        handles = await requests.submit_prompts(req.prompts)
        await asyncio.gather(*(requests.wait(h) for h in handles))
        return generate_results(req, handles, self._tokens)

    def encode(self, prompt: str | list[str] | None = None,
               input_ids: list[int] | list[list[int]] | None = None,
               **fields: Any) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `Engine.encode` (an `--is-embedding` server's `/encode`) offline: one
        {"embedding", "meta_info"} for one input, else a list. Needs `is_embedding=True`."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        if not self.args.is_embedding:
            raise InvalidRequest(f"LLM.encode: {EMBEDDING_ONLY} (is_embedding=True)")
        req = parse_encode({"text": prompt, **fields, "input_ids": input_ids},
                           EmbeddingShape.of(self.runtime), None)
        return _run(self._loop, self._encode(req))

    async def _encode(self, req: EmbeddingRequest) -> Any:
        return encode_results(req, await embed(self.runtime.requests, req))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        """Serve a PEFT adapter folder under `lora_name` (SGLang's Engine method)."""
        _run(self._loop, self.runtime.load_adapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> None:
        _run(self._loop, self.runtime.unload_adapter(lora_name))

    def check_integrity(self) -> None:
        self.runtime.check_integrity()

    def shutdown(self) -> None:
        """Abort what runs, stop the scheduler and the engine; idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _run(loop: asyncio.AbstractEventLoop, coroutine: Any) -> Any:
    """Run the event loop (scheduler included) on the caller's thread until `coroutine` is
    done; the caller's own torch work between calls keeps its threads."""
    with no_openmp_on_this_thread():
        return loop.run_until_complete(coroutine)


def _shutdown(loop: asyncio.AbstractEventLoop, runtime: Runtime) -> None:
    if loop.is_closed():
        return
    try:
        _run(loop, runtime.stop())
        _run(loop, loop.shutdown_asyncgens())
    finally:
        loop.close()


"""The offline API: `LLM(...).generate(...)`, driving the same scheduler as the server."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from minisgl.args import ServerArgs
from minisgl.core import SamplingParams
from minisgl.env import no_openmp_on_this_thread
from minisgl.errors import InvalidRequest
from minisgl.runtime import Runtime
from minisgl.scheduler import RequestSpec, expand_samples


class LLM:
    """`LLM(model=None, dtype="auto", **server_args)`; `model=None` is the bundled SmolLM2.

    `shutdown()` stops it (also `with LLM(...) as llm:`); one still running when the
    interpreter exits is shut down then, quietly."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **server_args: Any) -> None:
        self.args = ServerArgs(model_path=model, dtype=dtype, **server_args)
        self.runtime = Runtime(self.args)
        self._loop = asyncio.new_event_loop()
        # NOTE: the finalizer holds the loop and the runtime, never self, so an LLM that is
        # dropped is shut down by the garbage collector, and one still alive at exit by atexit.
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self.runtime)
        _run(self._loop, self.runtime.start())

    @property
    def tokenizer(self) -> Any:
        return self.runtime.tokenizer.hf if self.runtime.tokenizer else None

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | SamplingParams | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt (or ids) gives one SGLang-style dict; a list, or n > 1, gives a list
        (prompt i's n samples in a row). With return_logprob, meta_info holds SGLang's output
        and input token logprobs (the input ones from prompt position logprob_start_len; -1:
        the last prompt token only). The batch is validated whole before anything runs."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        return _run(self._loop, self._generate(prompt, sampling_params, input_ids,
                                               return_logprob, top_logprobs_num,
                                               logprob_start_len))

    async def _generate(self, prompt: Any, sampling_params: Any, input_ids: Any,
                        return_logprob: bool, top_logprobs_num: int,
                        logprob_start_len: int) -> Any:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            ids = await self.runtime.requests.encode([prompt] if single else list(prompt))
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        if len(params) != len(ids):
            raise InvalidRequest("sampling_params list and prompts differ in length")
        params = [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
                  for p in params]
        logprob_num = top_logprobs_num if return_logprob else -1
        specs = [RequestSpec(one_ids, one_params, logprob_num=logprob_num,
                             logprob_start_len=logprob_start_len if return_logprob else -1)
                 for one_ids, one_params in zip(ids, params)]
        requests = self.runtime.requests
        groups = expand_samples(specs, requests.max_sequences)
        handles = requests.submit([s for group in groups for s in group])
        done = await asyncio.gather(*(requests.wait(h) for h in handles))
        results = [h.result() for h in done]
        return results[0] if single and len(results) == 1 else results

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

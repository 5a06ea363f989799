"""The offline API: `LLM(...).generate(...)`, driving the same scheduler as the server."""

from __future__ import annotations

import asyncio
from typing import Any

from minisgl.core import InvalidRequest, SamplingParams
from minisgl.engine import no_openmp_on_this_thread
from minisgl.server.manager import RequestManager
from minisgl.server_args import ServerArgs


class LLM:
    """`LLM(model=None, dtype="auto", **server_args)`; `model=None` is the bundled SmolLM2."""

    def __init__(self, model: str | None = None, dtype: str = "auto", **server_args: Any) -> None:
        self.args = ServerArgs(model_path=model, dtype=dtype, **server_args)
        self._loop = asyncio.new_event_loop()
        self.manager = RequestManager(self.args)
        self._run(self.manager.start())

    @property
    def tokenizer(self) -> Any:
        return self.manager.tokenizer.hf if self.manager.tokenizer else None

    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | SamplingParams | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1) -> dict[str, Any] | list[dict[str, Any]]:
        """One prompt (or ids) gives one SGLang-style dict; a list gives a list. With
        return_logprob, meta_info holds SGLang's output and input token logprobs (the input
        ones from prompt position logprob_start_len; -1: the last prompt token only)."""
        return self._run(self._generate(prompt, sampling_params, input_ids, return_logprob,
                                        top_logprobs_num, logprob_start_len))

    def _run(self, coroutine: Any) -> Any:
        """Run the event loop (scheduler included) on the caller's thread until `coroutine`
        is done; the caller's own torch work between calls keeps its threads."""
        with no_openmp_on_this_thread():
            return self._loop.run_until_complete(coroutine)

    async def _generate(self, prompt: Any, sampling_params: Any, input_ids: Any,
                        return_logprob: bool, top_logprobs_num: int,
                        logprob_start_len: int) -> Any:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            if self.manager.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: pass input_ids")
            ids = await self.manager.tokenizer.encode([prompt] if single else list(prompt))
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(ids)
        if len(params) != len(ids):
            raise InvalidRequest("sampling_params list and prompts differ in length")
        params = [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
                  for p in params]
        logprob_num = top_logprobs_num if return_logprob else -1
        handles = []
        try:
            for one_ids, one_params in zip(ids, params):
                handles.append(self.manager.submit(
                    one_ids, one_params, logprob_num=logprob_num,
                    logprob_start_len=logprob_start_len if return_logprob else -1))
        except Exception:
            for handle in handles:  # all or nothing: a bad prompt leaves nothing running
                self.manager.abort(handle.rid, "another prompt of the batch was invalid")
            raise
        done = await asyncio.gather(*(self.manager.wait(h) for h in handles))
        results = [h.result() for h in done]
        return results[0] if single else results

    def check_integrity(self) -> None:
        self.manager.scheduler.check_integrity()

    def shutdown(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.manager.stop())
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

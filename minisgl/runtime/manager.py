"""The request manager: the scheduler task and the detokenizer coroutine on one event loop.

HTTP handlers and the offline `LLM` both talk to it: `submit` queues requests and returns
handles whose state grows as the scheduler produces tokens; `updates` yields a handle's
cumulative state whenever it changed (several steps coalesce when a client reads slowly).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch

from minisgl.core import ImageInput, PromptImages, SamplingParams
from minisgl.errors import EngineFailed, InvalidRequest
from minisgl.grammar import GrammarBackend
from minisgl.runtime.images import IMAGE_MARKER, ImageLimits, lay_out_images, prepare_images
from minisgl.runtime.metrics import Metrics
from minisgl.runtime.request_log import RequestLog
from minisgl.runtime.tokenizer import DecodeState, IncrementalDetokenizer, Tokenizer
from minisgl.scheduler import Queued, ReqEvent, RequestSpec, Scheduler

logger = logging.getLogger(__name__)


def stop_token(reason: dict[str, Any] | None) -> str | bool:
    """"stop" for a request a stop token ended (its text is trimmed), else True: it ended."""
    return "stop" if reason is not None and isinstance(reason.get("matched"), int) else True


@dataclass(frozen=True)
class ChatPrompt:
    """Messages for the chat template (with its keyword arguments), then `prefix`: the start
    of the answer, which the model continues."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    prefix: str = ""


@dataclass
class Prompt(RequestSpec):
    """A request to submit; a text or chat prompt gets its input_ids on submission (samples
    of one prompt share its text or chat object, which is tokenized once)."""

    text: str | None = None
    chat: ChatPrompt | None = None
    # the prompt's images (runtime.images' sources), one per image placeholder, in order; a
    # chat prompt's are its image parts', marked in its messages by IMAGE_MARKER
    image_data: list[Any] | None = None


@dataclass
class ReqHandle:
    """One request as its client sees it: the state grows as events arrive."""

    rid: str
    prompt_ids: list[int]
    detok: DecodeState  # the detokenizer's state: text so far, stop strings and regexes
    logprob_num: int
    params: SamplingParams | None = None
    streaming: bool = False  # the client reads it as a stream (metrics' is_streaming label)
    created: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0
    tier_tokens: dict[str, int] | None = None  # hierarchical cache: each tier's share of those
    spec: tuple[int, int, int] | None = None  # speculating: (verify steps, drafted, accepted)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    logprob_start_len: int = -1  # first prompt position of input_token_logprobs (-1: none)
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    embedding: torch.Tensor | None = None  # an embedding request's: [hidden] float32, normalised
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @classmethod
    def open(cls, spec: RequestSpec, queued: Queued, streaming: bool) -> ReqHandle:
        """The handle of `spec`, as the scheduler queued it."""
        return cls(queued.rid, spec.input_ids, DecodeState.start(spec.input_ids, queued.params),
                   spec.logprob_num, queued.params, streaming,
                   logprob_start_len=spec.logprob_start_len)

    @property
    def text(self) -> str:
        return self.detok.visible_text

    @property
    def output_ids(self) -> list[int]:
        return self.detok.output_ids

    @property
    def cached_tokens_details(self) -> dict[str, Any]:
        """`cached_tokens` by where they came from, under SGLang's names: the pool (`device`),
        the hierarchical cache's host tier and its disk (`storage`)."""
        tiers = self.tier_tokens or {}
        lower = sum(tiers.values())
        return {"device": self.cached_tokens - lower, "host": tiers.get("host", 0),
                "storage": tiers.get("disk", 0),
                "storage_backend": "file" if "disk" in tiers else None}


class RequestManager:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer | None,
                 grammar: GrammarBackend | None = None, metrics: Metrics | None = None,
                 request_log: RequestLog | None = None, image_limits: ImageLimits | None = None
                 ) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.image_processor = scheduler.engine.image_processor  # None: no images served
        self.image_limits = image_limits
        # the images of live requests by content: requests reading one image share its
        # processed pixels
        self._images: weakref.WeakValueDictionary[int, ImageInput] = (
            weakref.WeakValueDictionary())
        self.grammar = grammar or GrammarBackend()
        self.detokenizer = IncrementalDetokenizer(tokenizer.hf) if tokenizer else None
        self.metrics = metrics or Metrics()
        self.request_log = request_log
        self.handles: dict[str, ReqHandle] = {}
        self._outbox: asyncio.Queue[list[ReqEvent]] | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.crash: str | None = None  # why the scheduler or detokenizer task ended early
        self._crashed = asyncio.Event()

    @property
    def running(self) -> bool:
        return (bool(self._tasks) and not any(t.done() for t in self._tasks)
                and self.scheduler.engine.failed is None)

    @property
    def max_sequences(self) -> int:
        """Sequences one request may ask for (prompts x n)."""
        return self.scheduler.limits.max_sequences

    async def start(self) -> None:
        self._outbox = self.scheduler.open_outbox()
        self._stopping = False
        self._tasks = [asyncio.create_task(self.scheduler.run(), name="minisgl-scheduler"),
                       asyncio.create_task(self._detokenize_loop(), name="minisgl-detokenizer")]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)

    async def stop(self) -> None:
        self._stopping = True
        self.scheduler.stop()
        scheduler_task, detok_task = self._tasks
        await asyncio.gather(scheduler_task, return_exceptions=True)  # a crash was logged
        while self._outbox is not None and not self._outbox.empty() and not detok_task.done():
            await asyncio.sleep(0)
        detok_task.cancel()
        await asyncio.gather(detok_task, return_exceptions=True)
        self._tasks = []

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A scheduler or detokenizer that ends outside `stop` is a crash: log it and end
        every open request, so that no client waits forever."""
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, EngineFailed):  # a tensor-parallel rank died: say which, no trace
            logger.error("%s stopped: %s", task.get_name(), exc)
            message = str(exc)
        else:  # NOTE: the record's first line names the cause; its trace follows
            cause = "cancelled" if exc is None else f"{type(exc).__name__}: {exc}"
            logger.error("%s stopped: %s", task.get_name(), cause, exc_info=exc)
            message = f"internal error: the server's {task.get_name()} task stopped ({cause})"
        self.crash = message
        self._crashed.set()
        now = time.perf_counter()
        for handle in list(self.handles.values()):
            self._close(handle, {"type": "abort", "message": message}, now)
            handle.changed.set()

    async def wait_crashed(self) -> str:
        """Returns `crash` once the scheduler or the detokenizer ended outside `stop`."""
        await self._crashed.wait()
        assert self.crash is not None
        return self.crash

    # ---- requests ----------------------------------------------------------------------------

    def submit(self, specs: list[RequestSpec], streaming: bool = False) -> list[ReqHandle]:
        """Queue a batch, all or nothing: every request is validated before any is queued
        (raises InvalidRequest, QueueFull or EngineFailed)."""
        if self.scheduler.engine.failed is not None:
            raise EngineFailed(self.scheduler.engine.failed)
        if self.detokenizer is None and any(s.params.stop_strings or s.params.stop_regexes
                                            for s in specs):
            raise InvalidRequest("stop strings and stop_regex need a tokenizer, and this model "
                                 "has none")
        queued = self.scheduler.add_requests(specs, rid_taken=self.handles.__contains__)
        handles = []
        for spec, accepted in zip(specs, queued):  # NOTE: one per spec, in order
            handle = ReqHandle.open(spec, accepted, streaming)
            self.handles[handle.rid] = handle
            self.metrics.on_submit()
            handles.append(handle)
        return handles

    async def submit_prompts(self, prompts: list[Prompt], streaming: bool = False
                             ) -> list[ReqHandle]:
        """Tokenize the text prompts (one batched call) and apply the chat template to chat
        prompts, prepare their images, compile their grammars, then queue the batch, all or
        nothing."""
        if self.image_processor is None and any(p.image_data for p in prompts):
            raise InvalidRequest("image_data and image parts are not served by "
                                 f"{self.scheduler.engine.arch.architecture} (no vision tower "
                                 "in this checkpoint, or the model takes none)")
        texts = [p for p in prompts if p.text is not None]
        for p in texts:
            if p.image_data and p.text:  # a model may write its images out as text (Gemma 3)
                p.text = self._image_text(p.text)
        # NOTE: an empty text is not tokenized (that could add a BOS): its empty input_ids are
        # refused by the scheduler's intake, as an empty list of ids is
        unique = list(dict.fromkeys(p.text for p in texts if p.text))  # n > 1 repeats a text
        ids = dict(zip(unique, await self.encode(unique))) if unique else {}
        for p in texts:
            p.input_ids = ids.get(p.text, [])
        chats: dict[int, list[int]] = {}
        for p in prompts:
            if p.chat is not None:
                if id(p.chat) not in chats:
                    chats[id(p.chat)] = await self.encode_chat(p.chat)
                p.input_ids = chats[id(p.chat)]
        await self.attach_images(prompts)
        await self.attach_grammars(prompts)
        return self.submit(list(prompts), streaming)

    async def attach_images(self, prompts: list[Prompt]) -> None:
        """Each prompt's images read, processed and laid into its ids (the samples of one
        prompt share them); raises InvalidRequest naming the image."""
        laid_out: dict[int, tuple[list[int], PromptImages]] = {}
        for p in prompts:
            if not p.image_data:
                continue
            assert self.image_processor is not None and self.image_limits is not None
            key = id(p.image_data)
            if key not in laid_out:
                images = [[self._images.setdefault(unit.key, unit) for unit in units]
                          for units in await prepare_images(p.image_data, self.image_processor,
                                                            self.image_limits)]
                laid_out[key] = lay_out_images(p.input_ids, images, self.image_processor,
                                               self.scheduler.context_len, self._encode_plain)
            p.input_ids, p.images = laid_out[key]

    def _image_text(self, text: str) -> str:
        """A prompt text with the model's image placeholders as its processor writes them out
        before tokenizing (Gemma 3's), else as it is."""
        expand = getattr(self.image_processor, "expand_text", None)
        return text if expand is None else expand(text)

    def _encode_plain(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer to lay its images out")
        return self.tokenizer.hf(text, add_special_tokens=False)["input_ids"]

    async def attach_grammars(self, specs: list[RequestSpec]) -> None:
        """Compile each grammar the batch asks for (off the event loop, cached) and give each
        sequence its own matcher; raises InvalidRequest with the compiler's message."""
        for spec in specs:
            grammar = spec.params.grammar
            if grammar is not None and spec.matcher is None:
                spec.matcher = self.grammar.matcher(await self.grammar.compile(*grammar),
                                                    spec.params.grammar_after)

    async def encode(self, texts: list[str], add_special_tokens: bool = True
                     ) -> list[list[int]]:
        """Token ids of prompt texts; a text longer than the context could hold at the
        tokenizer's most characters per token is refused before it is tokenized."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send input_ids instead of text")
        return await self.tokenizer.encode(texts, self.scheduler.context_len,
                                           add_special_tokens)

    async def encode_chat(self, chat: ChatPrompt) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer, so no chat template")
        messages = chat.messages
        if self.image_processor is not None:  # image parts: the model's own placeholder
            placeholder = self._image_text(self.image_processor.placeholder)
            messages = [{**m, "content": m["content"].replace(IMAGE_MARKER, placeholder)}
                        if isinstance(m.get("content"), str) else m for m in messages]
        return await self.tokenizer.encode_chat(messages, self.scheduler.context_len,
                                                chat.template_kwargs, chat.prefix)

    async def updates(self, handle: ReqHandle) -> AsyncIterator[ReqHandle]:
        """Yields the handle each time its state changed, last when it finished. Abandoning the
        iteration (a client went away) aborts the request."""
        try:
            while True:
                await handle.changed.wait()
                handle.changed.clear()
                # NOTE: read before the yield: the handle may finish while the consumer writes,
                # and its finished state must still be yielded
                finished = handle.finished
                yield handle
                if finished:
                    return
        finally:
            if not handle.finished:
                self.abort(handle.rid, "the client disconnected")

    async def wait(self, handle: ReqHandle) -> ReqHandle:
        async for _ in self.updates(handle):
            pass
        return handle

    def abort(self, rid: str, message: str = "aborted by the client") -> bool:
        if rid not in self.handles:
            return False
        self.scheduler.abort(rid, message)
        return True

    def abort_all(self, message: str = "aborted") -> None:
        for rid in list(self.handles):
            self.abort(rid, message)

    # ---- outputs -----------------------------------------------------------------------------

    async def _detokenize_loop(self) -> None:
        """The scheduler's events, one step's at a time (or those that queued up meanwhile),
        detokenized and applied to their handles."""
        assert self._outbox is not None
        while True:
            events = await self._outbox.get()
            while not self._outbox.empty():  # coalesce steps that queued up meanwhile
                events += self._outbox.get_nowait()
            self._apply(events)

    def _apply(self, events: list[ReqEvent]) -> None:
        """One batch of events: metrics, logprobs, text (IncrementalDetokenizer.step; the
        third value of each update says the request ends at a stop token, `stop_token`)."""
        now = time.perf_counter()
        updates = []
        for event in events:
            handle = self.handles.get(event.rid)
            if handle is None or handle.finished:
                continue
            handle.cached_tokens, handle.tier_tokens = event.cached_tokens, event.tier_tokens
            if event.spec is not None:
                handle.spec = event.spec
            if event.token is not None:
                if handle.first_token_at is None:
                    self.metrics.on_first_token(handle.streaming, now - handle.created,
                                                len(handle.prompt_ids), handle.cached_tokens, now)
                    handle.first_token_at = now
                else:
                    self.metrics.on_next_token(handle.streaming, now - handle.last_token_at,
                                               now)
                handle.last_token_at = now
                if event.logprob is not None:
                    handle.token_logprobs.append((event.logprob, event.token))
                    handle.top_logprobs.append(event.top_logprobs or [])
            if event.embedding is not None:
                handle.embedding = event.embedding
            if event.input_logprobs is not None:  # with the first token, or alone (scoring)
                handle.input_logprobs = event.input_logprobs
                handle.input_top_logprobs = event.input_top_logprobs or []
            updates.append((handle, event))
        if self.detokenizer is not None:
            stopped = self.detokenizer.step(
                [(h.detok, e.token, e.finished and stop_token(e.finish_reason))
                 for h, e in updates])
            for state in stopped:
                handle = next(h for h, _ in updates if h.detok is state)
                reason = state.finish_reason
                self.scheduler.finish(handle.rid, reason)
                self._close(handle, reason, now)
        else:
            for handle, event in updates:
                if event.token is not None:
                    handle.detok.output_ids.append(event.token)
        for handle, event in updates:
            if event.finished and not handle.finished:
                self._close(handle, event.finish_reason, now)
            handle.changed.set()

    def _close(self, handle: ReqHandle, reason: dict[str, Any] | None, now: float) -> None:
        handle.finished, handle.finish_reason, handle.finished_at = True, reason, now
        self.handles.pop(handle.rid, None)
        decode_seconds = (None if handle.first_token_at is None
                          else (handle.last_token_at or now) - handle.first_token_at)
        self.metrics.on_finish(
            handle.streaming, now - handle.created, decode_seconds, len(handle.prompt_ids),
            len(handle.output_ids), aborted=(reason or {}).get("type") == "abort",
            structured=handle.params is not None and handle.params.grammar is not None)
        if self.request_log is not None:
            self.request_log.finished(handle)

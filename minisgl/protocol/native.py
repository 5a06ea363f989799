"""SGLang's native requests (`GenerateReqInput`, as of SGLang 0.5.23): a `/generate` body (or
the offline `LLM.generate` arguments, named the same) and an `/abort_request` body.

The field policy is protocol.fields'; inside `sampling_params` an unknown key is a 400, as in
SGLang (core.SamplingParams).

The results: per request, `{"text", "output_ids", "meta_info"}` (and `prompt_token_ids` if
asked); for a batch, a list; for a stream, one cumulative result per chunk, with its `"index"`
in a streamed batch. Logprob entries are `[logprob, token_id, token_text_or_null]`, built once
each, with their text when the request asked for it (return_text_in_logprobs).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import (UnknownFields, batch_rids, check_adapter_name, check_bool,
                                     check_int, check_priority, flag, ids_prompts, none_as,
                                     per_item, refuse_unsupported, text_prompts)
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import Prompt, ReqHandle
from minisgl.scheduler import expand_samples

MAX_TOP_LOGPROBS = 100  # native API; the OpenAI endpoints allow 20, as OpenAI does

SUPPORTED_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "log_metrics",
    "return_prompt_token_ids", "priority", "lora_path", "image_data"})
# Bookkeeping, routing and tracing hints: nothing of the output depends on them.
INERT_FIELDS = frozenset({
    "no_logs", "conversation_id", "custom_labels", "external_trace_header",
    "received_time", "routing_key", "http_worker_ipc"})
# Features minisgl does not have (multimodal, LoRA, sessions, hidden states, disaggregation,
# data parallelism, custom logit processors, cache namespaces, extra logprob forms, ...).
UNSUPPORTED_FIELDS = frozenset({
    "input_embeds", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "watermark", "token_ids_logprob",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_id", "session_params", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "background", "require_reasoning",
    "max_thinking_tokens", "extra_key", "cache_salt", "return_bytes", "return_entropy",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints"})
KNOWN_FIELDS = SUPPORTED_FIELDS | INERT_FIELDS | UNSUPPORTED_FIELDS


# ---- /generate ---------------------------------------------------------------------------------

@dataclass
class GenerateRequest:
    groups: list[list[Prompt]]  # per prompt, its n samples
    single: bool  # answer one object (one prompt, n == 1) rather than a list
    stream: bool
    text_in_logprobs: bool
    prompt_ids_wanted: bool  # return_prompt_token_ids

    @property
    def prompts(self) -> list[Prompt]:
        return [p for group in self.groups for p in group]


def parse_generate(body: dict[str, Any], max_sequences: int,
                   unknown: UnknownFields | None = None) -> GenerateRequest:
    """A `/generate` body, or `LLM.generate`'s arguments (whose `sampling_params` may also be
    SamplingParams objects). Raises InvalidRequest; a batch with one bad element fails as a
    whole."""
    extra = set(body) - KNOWN_FIELDS
    if extra and unknown is not None:
        unknown.ignore("/generate", extra)
    refuse_unsupported(body, UNSUPPORTED_FIELDS)
    single, prompts = _prompts(body.get("text"), body.get("input_ids"))
    count = len(prompts)

    params = per_item(body.get("sampling_params"), count, "sampling_params", _sampling_params,
                      single)
    rids = batch_rids(body.get("rid"), count, single)
    want = per_item(body.get("return_logprob"), count, "return_logprob",
                    lambda v: check_bool(none_as(v, False), "return_logprob"), single)
    tops = per_item(none_as(body.get("top_logprobs_num"), 0), count, "top_logprobs_num",
                    lambda v: check_int(v, "top_logprobs_num", 0, MAX_TOP_LOGPROBS), single)
    starts = per_item(body.get("logprob_start_len"), count, "logprob_start_len",
                      lambda v: check_int(none_as(v, -1), "logprob_start_len", -1), single)
    priorities = per_item(body.get("priority"), count, "priority", check_priority, single)
    adapters = per_item(body.get("lora_path"), count, "lora_path", check_adapter_name, single)
    images = per_item(body.get("image_data"), count, "image_data", image_sources, single)
    for p, sp, r, w, k, start, prio, lora, image_data in zip(
            prompts, params, rids, want, tops, starts, priorities, adapters, images):
        p.params, p.rid, p.logprob_num, p.priority = sp, r, (k if w else -1), prio
        p.lora, p.image_data = lora, image_data
        p.logprob_start_len = start if w else -1

    flag(body, "log_metrics", True)
    groups = expand_samples(prompts, max_sequences)
    return GenerateRequest(groups, single and len(groups[0]) == 1, flag(body, "stream"),
                           flag(body, "return_text_in_logprobs"),
                           flag(body, "return_prompt_token_ids"))


def _prompts(text: Any, input_ids: Any) -> tuple[bool, list[Prompt]]:
    """(one prompt rather than a list, the prompts) of `text` or `input_ids`."""
    if text is None and input_ids is None:
        raise InvalidRequest("give text or input_ids")
    if text is not None:  # NOTE: as SGLang: text wins when both are given
        prompts = text_prompts(text)
        if prompts is None:
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        return prompts
    prompts = ids_prompts(input_ids)
    if prompts is None:
        raise InvalidRequest("input_ids must be a non-empty list of token ids or a non-empty "
                             "list of such lists")
    return prompts


def image_sources(value: Any) -> list[Any] | None:
    """One prompt's `image_data`: an image (a URL, a data URL, a file path or base64; offline
    also a PIL image) or a list of them, in the order of the prompt's image placeholders."""
    if value is None or value == []:
        return None
    sources = list(value) if isinstance(value, list) else [value]
    for i, source in enumerate(sources):
        if isinstance(source, dict) and isinstance(source.get("url"), str):
            sources[i] = source = source["url"]
        if not (isinstance(source, str) and source) and not hasattr(source, "getpixel"):
            raise InvalidRequest(f"image_data: image {i} must be a non-empty string (a URL, a "
                                 "data URL, a file path or base64)")
    return sources


def _sampling_params(value: Any) -> SamplingParams:
    """A `sampling_params` object, or (offline) a SamplingParams, copied and checked alike."""
    if isinstance(value, SamplingParams):
        params = copy.deepcopy(value)  # NOTE: the caller's object stays as it was given
        params.validate()
        return params
    return SamplingParams.from_dict(value)


# ---- /abort_request ----------------------------------------------------------------------------

@dataclass
class AbortRequest:
    rid: str | None  # None: abort every running request (abort_all)


def parse_abort(body: dict[str, Any]) -> AbortRequest:
    if flag(body, "abort_all"):
        return AbortRequest(None)
    rid = body.get("rid")
    if not isinstance(rid, str):
        raise InvalidRequest("give rid (a string) or abort_all: true")
    return AbortRequest(rid)


# ---- /load_lora_adapter, /unload_lora_adapter --------------------------------------------------

@dataclass
class AdapterRequest:
    name: str
    path: str | None  # None: an unload
    pinned: bool = False


def parse_adapter_request(body: dict[str, Any], load: bool) -> AdapterRequest:
    """SGLang's {lora_name, lora_path, pinned} (vLLM's {lora_name, lora_path} alike)."""
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("lora_name must be a non-empty string")
    if not load:
        return AdapterRequest(name, None)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise InvalidRequest("lora_path must be a non-empty string (the adapter's folder)")
    return AdapterRequest(name, path, check_bool(none_as(body.get("pinned"), False), "pinned"))


Pair = tuple[float, int]  # (logprob, token id), as the request handle keeps them


class ResultShaper:
    """Shapes one request's results. Kept across a stream's chunks, it converts only the
    logprob entries that are new since the last chunk and appends them to lists it keeps, so a
    chunk costs what is new while the JSON still carries SGLang's cumulative lists.

    NOTE: successive results share those lists: serialize a result before asking for the next.
    The prompt's logprobs arrive at most once and only grow, as the output's do."""

    def __init__(self, tokens: TokenTexts | None, prompt_ids_wanted: bool) -> None:
        self.tokens, self.prompt_ids_wanted = tokens, prompt_ids_wanted
        self.output_token_logprobs: list[list[Any]] = []
        self.output_top_logprobs: list[list[list[Any]]] = []
        self.input_token_logprobs: list[list[Any]] = []
        self.input_top_logprobs: list[list[list[Any]] | None] = []

    def result(self, h: ReqHandle) -> dict[str, Any]:
        result = {"text": h.text, "output_ids": list(h.output_ids), "meta_info": self.meta(h)}
        if self.prompt_ids_wanted:
            result["prompt_token_ids"] = list(h.prompt_ids)
        return result

    def meta(self, h: ReqHandle) -> dict[str, Any]:
        end = h.finished_at or time.perf_counter()
        meta: dict[str, Any] = {
            "id": h.rid,
            "finish_reason": h.finish_reason,
            "prompt_tokens": len(h.prompt_ids),
            "completion_tokens": len(h.output_ids),
            "cached_tokens": h.cached_tokens,
            "e2e_latency": end - h.created,
        }
        if h.tier_tokens is not None:  # with the hierarchical cache
            meta["cached_tokens_details"] = h.cached_tokens_details
        if h.spec is not None:  # SGLang's names; accept length: tokens per verify step
            verify_ct, drafted, accepted = h.spec
            meta.update(spec_verify_ct=verify_ct, spec_draft_token_num=drafted,
                        spec_accept_token_num=accepted,
                        spec_accept_rate=accepted / drafted if drafted else 0.0,
                        spec_accept_length=(len(h.output_ids) / verify_ct if verify_ct
                                            else 0.0))
        if h.logprob_num >= 0:
            self._add_new_logprobs(h)
            meta["output_token_logprobs"] = self.output_token_logprobs
            meta["output_top_logprobs"] = self.output_top_logprobs
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["input_top_logprobs"] = self.input_top_logprobs
        return meta

    def _add_new_logprobs(self, h: ReqHandle) -> None:
        self.output_token_logprobs += self._entries(
            h.token_logprobs[len(self.output_token_logprobs):])
        self.output_top_logprobs += self._steps(h.top_logprobs[len(self.output_top_logprobs):])
        if h.logprob_start_len < 0:  # -1 (the default) starts at the prompt's end: no entries
            return
        # SGLang's layout: the token at logprob_start_len gets None (nothing before it was
        # scored), each later prompt token its logprob given everything before it
        start, values = h.logprob_start_len, h.input_logprobs
        known = min(len(h.prompt_ids) - start, 1 + len(values))
        self.input_token_logprobs += self._entries(
            [(values[j - 1] if j else None, h.prompt_ids[start + j])
             for j in range(len(self.input_token_logprobs), known)])
        if not self.input_top_logprobs:
            self.input_top_logprobs.append(None)
        self.input_top_logprobs += self._steps(
            h.input_top_logprobs[len(self.input_top_logprobs) - 1:])

    def _texts(self, ids: list[int]) -> list[str | None]:
        return self.tokens.texts(ids) if self.tokens is not None else [None] * len(ids)

    def _entries(self, pairs: list[tuple[float | None, int]]) -> list[list[Any]]:
        texts = self._texts([t for _, t in pairs])
        return [[lp, t, text] for (lp, t), text in zip(pairs, texts)]

    def _steps(self, steps: list[list[Pair]]) -> list[list[list[Any]]]:
        texts = iter(self._texts([t for step in steps for _, t in step]))
        return [[[lp, t, next(texts)] for lp, t in step] for step in steps]


def _shaper(req: GenerateRequest, tokens: TokenTexts) -> ResultShaper:
    return ResultShaper(tokens if req.text_in_logprobs else None, req.prompt_ids_wanted)


def generate_results(req: GenerateRequest, handles: list[ReqHandle], tokens: TokenTexts
                     ) -> dict[str, Any] | list[dict[str, Any]]:
    """The answer to a finished `/generate`: one result, or a list (prompt i's n samples in a
    row)."""
    results = [_shaper(req, tokens).result(h) for h in handles]
    return results[0] if req.single else results


class GenerateStream:
    """The chunks of a streamed `/generate`: request i's cumulative result each time its
    tokens, text or state changed."""

    def __init__(self, req: GenerateRequest, tokens: TokenTexts) -> None:
        self.req, self.tokens = req, tokens
        self._shapers: dict[int, ResultShaper] = {}
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def chunk(self, i: int, h: ReqHandle) -> dict[str, Any] | None:
        key = (len(h.output_ids), h.detok.visible_len, h.finished)  # no text copy
        if self._sent.get(i) == key:
            return None
        self._sent[i] = key
        if i not in self._shapers:
            self._shapers[i] = _shaper(self.req, self.tokens)
        result = self._shapers[i].result(h)
        if not self.req.single:
            result["index"] = i
        return result

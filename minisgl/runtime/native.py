"""SGLang's native request (`GenerateReqInput`, as of SGLang 0.5.23): parsing a `/generate`
body, the offline `LLM.generate` arguments, and the result dicts.

Field policy, the same on every endpoint:
- a field minisgl acts on is checked and used;
- a field that changes nothing a client sees (`INERT_FIELDS`) is accepted with any value;
- a field for a feature minisgl lacks (`UNSUPPORTED_FIELDS`) is accepted at its default (null,
  false, 0, empty) and refused with a 400 that names it otherwise;
- a field no SGLang release defines is ignored, and logged once at warning level (`Unknown`),
  as vLLM's and SGLang's OpenAI servers ignore unknown fields.
Inside `sampling_params` an unknown key is a 400, as in SGLang (core.SamplingParams).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from minisgl.core import SamplingParams, asks_nothing
from minisgl.errors import InvalidRequest
from minisgl.runtime.manager import Prompt, ReqHandle
from minisgl.runtime.token_texts import TokenTexts
from minisgl.scheduler import expand_samples

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 100  # native API; the OpenAI endpoints allow 20, as OpenAI does

SUPPORTED_FIELDS = frozenset({
    "text", "input_ids", "sampling_params", "rid", "stream", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "log_metrics",
    "return_prompt_token_ids", "priority"})
# Bookkeeping, routing and tracing hints: nothing of the output depends on them.
INERT_FIELDS = frozenset({
    "no_logs", "conversation_id", "custom_labels", "external_trace_header",
    "received_time", "routing_key", "http_worker_ipc"})
# Features minisgl does not have (multimodal, LoRA, sessions, hidden states, disaggregation,
# data parallelism, custom logit processors, cache namespaces, extra logprob forms, ...).
UNSUPPORTED_FIELDS = frozenset({
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "watermark", "token_ids_logprob",
    "return_sampling_mask", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_id", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "background", "require_reasoning",
    "max_thinking_tokens", "extra_key", "cache_salt", "return_bytes", "return_entropy",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints"})
KNOWN_FIELDS = SUPPORTED_FIELDS | INERT_FIELDS | UNSUPPORTED_FIELDS


class UnknownFields:
    """Ignores fields no endpoint knows, logging each name once (no log flooding)."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def ignore(self, where: str, names: set[str] | list[str]) -> None:
        new = sorted(n for n in names if (where, n) not in self._logged)
        if new:
            self._logged.update((where, n) for n in new)
            logger.warning("%s: ignoring unknown field(s) %s (logged once)", where,
                           ", ".join(new))


def refuse_unsupported(body: dict[str, Any], names: frozenset[str] | set[str]) -> None:
    for name in sorted(names & set(body)):
        if not asks_nothing(body[name]):
            raise InvalidRequest(f"{name} is not supported by minisgl")


# ---- small type checks -----------------------------------------------------------------------

def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(t) for t in value)


def none_as(value: Any, default: Any) -> Any:
    """JSON null means the field's default."""
    return default if value is None else value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{name} must be an integer {bound}, got {value!r}")
    return value


def check_priority(value: Any) -> int | None:
    """A request's `priority` (used with --enable-priority-scheduling): an integer or null."""
    if value is not None and not is_int(value):
        raise InvalidRequest(f"priority must be an integer, got {value!r}")
    return value


def per_item(value: Any, count: int, name: str, check: Callable[[Any], Any],
             single: bool) -> list[Any]:
    """A field that is one value for every prompt or (in a batch) a list with one per prompt."""
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} elements for {count} prompts")
        return [check(v) for v in value]
    return [check(value)] * count


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
    """A `/generate` body (or `LLM.generate`'s arguments, named the same). Raises
    InvalidRequest; a batch with one bad element fails as a whole."""
    extra = set(body) - KNOWN_FIELDS
    if extra and unknown is not None:
        unknown.ignore("/generate", extra)
    refuse_unsupported(body, UNSUPPORTED_FIELDS)
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise InvalidRequest("give text or input_ids")
    if text is not None:  # NOTE: as SGLang: text wins when both are given
        if isinstance(text, str):
            single, texts = True, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            single, texts = False, text
        else:
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        prompts = [Prompt([], SamplingParams(), text=t) for t in texts]
    else:
        if is_ids(input_ids) and input_ids:
            single, batches = True, [input_ids]
        elif isinstance(input_ids, list) and input_ids and all(is_ids(x) for x in input_ids):
            single, batches = False, input_ids
        else:
            raise InvalidRequest("input_ids must be a non-empty list of token ids or a "
                                 "non-empty list of such lists")
        prompts = [Prompt(list(ids), SamplingParams()) for ids in batches]
    count = len(prompts)

    params = per_item(body.get("sampling_params"), count, "sampling_params",
                      SamplingParams.from_dict, single)

    def check_rid(r: Any) -> str | None:
        if r is not None and (not isinstance(r, str) or not r):
            raise InvalidRequest(f"rid must be a non-empty string, got {r!r}")
        return r

    rid = body.get("rid")
    if not single and isinstance(rid, str):  # as SGLang: one rid names a batch's items
        rid = [f"{rid}_{i}" for i in range(count)]
    rids = per_item(rid, count, "rid", check_rid, single)
    want = per_item(body.get("return_logprob"), count, "return_logprob",
                    lambda v: check_bool(none_as(v, False), "return_logprob"), single)
    tops = per_item(none_as(body.get("top_logprobs_num"), 0), count, "top_logprobs_num",
                    lambda v: check_int(v, "top_logprobs_num", 0, MAX_TOP_LOGPROBS), single)
    starts = per_item(body.get("logprob_start_len"), count, "logprob_start_len",
                      lambda v: check_int(none_as(v, -1), "logprob_start_len", -1), single)
    priorities = per_item(body.get("priority"), count, "priority", check_priority, single)
    for p, sp, r, w, k, start, prio in zip(prompts, params, rids, want, tops, starts,
                                           priorities):
        p.params, p.rid, p.logprob_num, p.priority = sp, r, (k if w else -1), prio
        p.logprob_start_len = start if w else -1

    def flag(name: str, default: bool) -> bool:
        return check_bool(none_as(body.get(name), default), name)

    flag("log_metrics", True)
    groups = expand_samples(prompts, max_sequences)
    return GenerateRequest(groups, single and len(groups[0]) == 1, flag("stream", False),
                           flag("return_text_in_logprobs", False),
                           flag("return_prompt_token_ids", False))


def generate_result(handle: ReqHandle, tokens: TokenTexts | None,
                    prompt_ids: bool = False) -> dict[str, Any]:
    """SGLang's result dict: text, output_ids, meta_info (and prompt_token_ids if asked), with
    the logprob entries' token text filled in if `tokens` is given."""
    result = handle.result()
    meta = result["meta_info"]
    if tokens is not None and "output_token_logprobs" in meta:
        entries = [*meta["output_token_logprobs"], *meta["input_token_logprobs"]]
        entries += [e for key in ("output_top_logprobs", "input_top_logprobs")
                    for step in meta[key] if step is not None for e in step]
        for entry, text in zip(entries, tokens.texts([e[1] for e in entries])):
            entry[2] = text
    if prompt_ids:
        result["prompt_token_ids"] = list(handle.prompt_ids)
    return result

"""Embedding requests (--is-embedding): OpenAI's `/v1/embeddings` body and SGLang's native
`/encode` body (`EmbeddingReqInput`) in, their answers out.

An embedding is the final hidden state (after the model's last norm) at the input's last
token, L2-normalised: one prefill, nothing generated. The field policy is protocol.fields'.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.protocol.fields import (UnknownFields, batch_rids, check_adapter_name, check_priority,
                                     ids_prompts, is_int, per_item, refuse_unsupported,
                                     text_prompts)
from minisgl.protocol.native import (INERT_FIELDS as NATIVE_INERT_FIELDS,
                                     UNSUPPORTED_FIELDS as NATIVE_UNSUPPORTED_FIELDS)
from minisgl.protocol.openai_models import OpenAIModel
from minisgl.runtime import Prompt, ReqHandle, RequestManager, Runtime

ENCODING_FORMATS = ("float", "base64")
OPENAI_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user",
                           "priority", "lora_path"})
NATIVE_FIELDS = frozenset({"text", "input_ids", "rid", "priority", "lora_path", "dimensions",
                           "log_metrics"})
# images are served to generation only
NATIVE_REFUSED_FIELDS = NATIVE_UNSUPPORTED_FIELDS | {"image_data"}
NATIVE_KNOWN_FIELDS = NATIVE_FIELDS | NATIVE_INERT_FIELDS | NATIVE_REFUSED_FIELDS
GENERATION_ONLY = ("this server serves embeddings (started with --is-embedding); restart "
                   "it without --is-embedding to generate text")
EMBEDDING_ONLY = ("embeddings are served only by a server started with --is-embedding; this "
                  "one generates text")


@dataclass(frozen=True)
class EmbeddingShape:
    """What the served model's embeddings look like, for the checks of a request."""

    dimensions: int  # the hidden size
    vocab_size: int
    max_inputs: int  # --max-sequences-per-request

    @classmethod
    def of(cls, runtime: Runtime) -> EmbeddingShape:
        arch = runtime.engine.arch
        return cls(arch.hidden_size, arch.vocab_size, runtime.requests.max_sequences)


@dataclass
class EmbeddingRequest:
    prompts: list[Prompt]
    single: bool  # native: one input (a string, a list of ids), answered with one object
    model: str = ""  # OpenAI: the name the answer reports
    encoding_format: str = "float"


def parse_openai_embeddings(body: dict[str, Any], model: OpenAIModel, shape: EmbeddingShape,
                            unknown: UnknownFields) -> EmbeddingRequest:
    """A `/v1/embeddings` body; raises InvalidRequest naming the field."""
    extra = set(body) - OPENAI_FIELDS
    if extra:
        unknown.ignore("/v1/embeddings", extra)
    name, adapter = model.resolve(body)
    if body.get("input") is None:
        raise InvalidRequest("give input: a string, a list of strings or token ids")
    single, prompts = _inputs(body["input"], "input", shape, text=True, ids=True)
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODING_FORMATS:
        raise InvalidRequest(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                             f"got {fmt!r}")
    _check_dimensions(body.get("dimensions"), shape)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest(f"user must be a string, got {user!r}")
    priority = check_priority(body.get("priority"))
    adapter = adapter or check_adapter_name(body.get("lora_path"))
    for p in prompts:
        p.priority, p.lora = priority, adapter
    return EmbeddingRequest(prompts, single, name, fmt)


def parse_encode(body: dict[str, Any], shape: EmbeddingShape, unknown: UnknownFields | None
                 ) -> EmbeddingRequest:
    """SGLang's `/encode` body: `text` (a string or a list of them) or `input_ids` (a list of
    ids or a list of such lists); raises InvalidRequest naming the field."""
    extra = set(body) - NATIVE_KNOWN_FIELDS
    if extra and unknown is not None:
        unknown.ignore("/encode", extra)
    refuse_unsupported(body, NATIVE_REFUSED_FIELDS)
    if body.get("text") is not None:  # NOTE: as /generate: text wins when both are given
        single, prompts = _inputs(body["text"], "text", shape, text=True, ids=False)
    elif body.get("input_ids") is not None:
        single, prompts = _inputs(body["input_ids"], "input_ids", shape, text=False, ids=True)
    else:
        raise InvalidRequest("give text or input_ids")
    _check_dimensions(body.get("dimensions"), shape)
    count = len(prompts)
    rids = batch_rids(body.get("rid"), count, single)
    priorities = per_item(body.get("priority"), count, "priority", check_priority, single)
    adapters = per_item(body.get("lora_path"), count, "lora_path", check_adapter_name, single)
    for p, r, prio, lora in zip(prompts, rids, priorities, adapters):
        p.rid, p.priority, p.lora = r, prio, lora
    return EmbeddingRequest(prompts, single)


SHAPES = {(True, True): "a string, a non-empty list of strings, a list of token ids or a "
          "non-empty list of such lists",
          (True, False): "a string or a non-empty list of strings",
          (False, True): "a non-empty list of token ids or a non-empty list of such lists"}


def _inputs(value: Any, name: str, shape: EmbeddingShape, text: bool, ids: bool
            ) -> tuple[bool, list[Prompt]]:
    """(one input rather than a list, one prompt per input) of field `name`, which may hold
    `text`, token `ids` or either."""
    found = (text_prompts(value) if text else None) or (ids_prompts(value) if ids else None)
    if found is None:
        raise InvalidRequest(f"{name} must be {SHAPES[text, ids]}")
    single, prompts = found
    if len(prompts) > shape.max_inputs:
        raise InvalidRequest(f"{name} holds {len(prompts)} inputs; at most {shape.max_inputs} "
                             "are allowed in one request (--max-sequences-per-request)")
    for i, p in enumerate(prompts):
        where = name if single else f"{name}[{i}]"
        if p.text == "" or (p.text is None and not p.input_ids):
            raise InvalidRequest(f"{where} is empty: an embedding needs at least one token")
        if p.text is None and (min(p.input_ids) < 0 or max(p.input_ids) >= shape.vocab_size):
            raise InvalidRequest(f"{where} must hold token ids in [0, {shape.vocab_size})")
        p.params, p.embed = SamplingParams(max_new_tokens=0), True
    return single, prompts


def _check_dimensions(value: Any, shape: EmbeddingShape) -> None:
    """Matryoshka truncation is not offered: only the model's own size is accepted."""
    if value is None:
        return
    if not is_int(value) or value < 1:
        raise InvalidRequest(f"dimensions must be a positive integer, got {value!r}")
    if value != shape.dimensions:
        raise InvalidRequest(
            f"dimensions {value} is not supported: this model's embeddings have "
            f"{shape.dimensions} dimensions and it was not trained to be cut shorter; leave "
            "dimensions out")


# ---- answers -----------------------------------------------------------------------------------

class EmbeddingAborted(RuntimeError):
    """An input got no embedding: it was aborted (a shutdown, /abort_request)."""


async def embed(requests: RequestManager, req: EmbeddingRequest) -> list[ReqHandle]:
    """Submit every input (one prefill each, batched by the scheduler) and wait for all;
    raises EmbeddingAborted if one was aborted. Cancelling the wait aborts the rest."""
    handles = await requests.submit_prompts(req.prompts)
    await asyncio.gather(*(requests.wait(h) for h in handles))
    for handle in handles:
        if handle.embedding is None:
            reason = handle.finish_reason or {}
            raise EmbeddingAborted(f"the request was aborted: "
                                   f"{reason.get('message', 'no embedding')}")
    return handles


def openai_embeddings_body(req: EmbeddingRequest, handles: list[ReqHandle]) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse; base64 is the float32 vector's little-endian bytes."""
    data = []
    for i, handle in enumerate(handles):
        assert handle.embedding is not None
        vector = handle.embedding.numpy()
        embedding: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                          if req.encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = sum(len(h.prompt_ids) for h in handles)
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def encode_results(req: EmbeddingRequest, handles: list[ReqHandle]
                   ) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's /encode answer: {"embedding", "meta_info"} per input, a list for a batch."""
    results = []
    for handle in handles:
        assert handle.embedding is not None
        latency = (handle.finished_at or handle.created) - handle.created
        results.append({"embedding": handle.embedding.numpy().tolist(), "meta_info": {
            "id": handle.rid, "finish_reason": handle.finish_reason,
            "prompt_tokens": len(handle.prompt_ids), "cached_tokens": handle.cached_tokens,
            "e2e_latency": latency}})
    return results[0] if req.single else results


"""The engine: the model, its device memory (KV pool, page table, token pool) and one forward.

`Engine.forward` is what the engine stream runs for a scheduled batch: gather input ids from
the token pool, run the model, sample, write the sampled ids back into the token pool (where
the next batch will gather them) and copy them to the host.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from minisgl.attention import AttentionBackend, create_attention_backend
from minisgl.core import Batch
from minisgl.distributed import TPInfo, get_tp_info
from minisgl.engine.sampler import SampleOutput, Sampler, SamplingArgs
from minisgl.engine.stream import create_stream
from minisgl.kvcache import KVPool
from minisgl.models import (
    ModelArch,
    build_model,
    init_dummy,
    load_config,
    load_safetensors,
    resolve_model_path,
)
from minisgl.server_args import ServerArgs

logger = logging.getLogger(__name__)

DTYPES = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float32": torch.float32}


@dataclass
class ForwardInput:
    batch: Batch
    load_indices: torch.Tensor  # flat token_pool indices of the input ids
    write_indices: torch.Tensor  # flat token_pool index for each real request's sampled id
    logit_rows: torch.Tensor | None  # which token rows need logits (prefill: each last token)
    sample_args: SamplingArgs


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # host copy, [batch.size] int32
    sample: SampleOutput  # logprobs, when asked, already on the host


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


class Engine:
    def __init__(self, args: ServerArgs, tp: TPInfo | None = None) -> None:
        self.args = args
        self.tp = tp or get_tp_info()
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.tp.rank)
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[args.dtype]
        started = time.perf_counter()
        self.model_path: Path = resolve_model_path(args.model_path)
        self.config = load_config(self.model_path)
        if args.json_model_override_args:
            self.config.update(json.loads(args.json_model_override_args))
        self.arch = ModelArch.from_config(self.config)
        self.context_len = args.context_length or self.arch.max_position_embeddings
        self.model = self._build_model()
        self.load_seconds = time.perf_counter() - started

        self.max_running = args.max_running_requests or (256 if self.device.type == "cuda" else 128)
        self.page_size = args.page_size
        self.kv_pool = self._allocate_kv_pool()
        rows = self.max_running + 1  # the last row belongs to the dummy request
        self.dummy_row = self.max_running
        self.page_table = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(rows, self.context_len, dtype=torch.int32, device=self.device)
        self.page_table[self.dummy_row].fill_(self.kv_pool.dummy_loc)
        self.attn_backend: AttentionBackend = create_attention_backend(
            args.attention_backend or ("flashinfer" if self.device.type == "cuda" else "torch"),
            self.kv_pool, self.page_table, self.arch.head_dim ** -0.5)
        self.sampler = Sampler(self.arch.vocab_size, self.device, list(self.arch.eos_token_ids))
        self.stream = create_stream(self.device)
        self.busy_seconds = 0.0
        self.phase_seconds = {"prefill": 0.0, "decode": 0.0}
        self.phase_steps = {"prefill": 0, "decode": 0}

    def _build_model(self) -> torch.nn.Module:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(self.arch)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.args.load_format == "dummy":
            init_dummy(model, self.args.seed)
        else:
            load_safetensors(model, self.model_path)
        return model.eval()

    def _allocate_kv_pool(self) -> KVPool:
        kv_heads = self.model.layers[0].self_attn.qkv_proj.num_kv_heads
        per_token = KVPool.bytes_per_token(self.arch.num_layers, kv_heads, self.arch.head_dim,
                                           self.dtype)
        tokens = self.args.max_total_tokens
        if tokens is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                fraction = self.args.mem_fraction_static or 0.85
                budget = free - total * (1 - fraction)
            else:
                budget = psutil.virtual_memory().available * (self.args.mem_fraction_static or 0.25)
            tokens = int(budget // per_token)
        num_pages = tokens // self.page_size
        if num_pages < 1:
            raise ValueError(f"no memory left for the KV cache ({tokens} tokens of "
                             f"{per_token} bytes); lower --mem-fraction-static or the model size")
        logger.info("KV pool: %d tokens in %d pages of %d (%.2f GiB)", num_pages * self.page_size,
                    num_pages, self.page_size, num_pages * self.page_size * per_token / 2**30)
        return KVPool(self.arch.num_layers, num_pages, self.page_size, kv_heads,
                      self.arch.head_dim, self.dtype, self.device)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_ids

    def forward(self, fwd: ForwardInput) -> ForwardOutput:
        """Runs on the engine stream (GPU) or the engine thread (CPU), in launch order."""
        started = time.perf_counter()
        batch = fwd.batch
        input_ids = self.token_pool.view(-1)[fwd.load_indices]
        logits = self.model(input_ids, batch.input_positions, batch, self.attn_backend,
                            fwd.logit_rows)
        sample = self.sampler.sample(logits[: batch.size], fwd.sample_args, self.token_pool)
        self.token_pool.view(-1)[fwd.write_indices] = sample.next_tokens
        tops = sample.top_logprobs
        output = ForwardOutput(
            next_tokens=_to_host(sample.next_tokens),
            sample=SampleOutput(next_tokens=sample.next_tokens, logprobs=_to_host(sample.logprobs),
                                top_logprobs=None if tops is None else
                                (_to_host(tops[0]), _to_host(tops[1]))))
        # NOTE: on CPU this is the real compute time; on CUDA only the launch time.
        elapsed = time.perf_counter() - started
        self.busy_seconds += elapsed
        self.phase_seconds[batch.phase] += elapsed
        self.phase_steps[batch.phase] += 1
        return output

    def shutdown(self) -> None:
        self.stream.close()


def _to_host(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None or x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)

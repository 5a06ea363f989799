"""Device memory: how many tokens the KV pool gets, and freeing everything at shutdown."""

from __future__ import annotations

import logging

import psutil
import torch

from minisgl.distributed.context import all_reduce_min
from minisgl.engine.config import EngineConfig
from minisgl.env import return_freed_heap
from minisgl.kvcache import KVLayout, KVPool
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers.embedding import ParallelLMHead
from minisgl.models import ModelArch

logger = logging.getLogger(__name__)


def allocate_kv_pool(config: EngineConfig, layout: KVLayout, page_size: int,
                     dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device,
                     tp_size: int, draft_bytes_per_token: int = 0) -> KVPool:
    """`--max-total-tokens`, else what the memory fraction leaves (after the weights are
    loaded; a draft model's KV pool, `draft_bytes_per_token`, takes its share); every rank
    takes the smallest count, so a page id means one slot everywhere. The pages hold
    `cache_dtype` (--kv-cache-dtype), read in `dtype`."""
    if device.type == "cpu":
        return_freed_heap()
    per_token = layout.bytes_per_token(cache_dtype)
    tokens = config.max_total_tokens
    fraction = config.mem_fraction_static
    if tokens is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - total * (1 - fraction)  # of device memory for weights + KV pool
        else:  # the ranks share the host's memory
            budget = psutil.virtual_memory().available * fraction / tp_size  # for the KV pool
        tokens = int(budget // (per_token + draft_bytes_per_token))
    tokens = all_reduce_min(tokens, device)
    num_pages = tokens // page_size
    if num_pages < 1:
        raise ValueError(f"no memory left for the KV cache ({tokens} tokens of {per_token} "
                         "bytes); lower --mem-fraction-static or the model size")
    pages = "" if cache_dtype == dtype else (
        f", {str(cache_dtype).removeprefix('torch.')} pages: "
        f"{layout.bytes_per_token(dtype) / per_token:.2f}x the tokens of "
        f"{str(dtype).removeprefix('torch.')} ones")
    logger.info("KV pool: %d tokens in %d pages of %d (%.2f GiB%s)", num_pages * page_size,
                num_pages, page_size, num_pages * page_size * per_token / 2**30, pages)
    return KVPool(layout, num_pages, page_size, dtype, device, cache_dtype)


def allocate_state_pool(arch: ModelArch, tp_size: int, rows: int, snapshots: int,
                        dtype: torch.dtype, device: torch.device, scratch: int = 0,
                        state_dtype: torch.dtype = torch.float32) -> StatePool:
    """A hybrid model's recurrent states (this rank's heads), one per table row, `snapshots`
    for the prefix cache and `scratch` per row for speculative verify steps (before the KV
    pool, which takes what memory is left)."""
    assert arch.linear is not None
    shape = arch.linear.split(tp_size)
    pool = StatePool(arch.linear_layers, rows, shape.conv_dim, shape.conv_kernel,
                     shape.state_shape, dtype, device, snapshots, scratch, state_dtype)
    logger.info("state pool: %d rows + %d prefix-cache snapshots + %d verify scratch of %d "
                "linear-attention layers (%.2f MiB each, %s states, %.2f GiB)", rows, snapshots,
                rows * scratch, arch.linear_layers, pool.bytes_per_state / 2**20,
                str(state_dtype).removeprefix("torch."), pool.nbytes / 2**30)
    return pool


def release_cuda_memory(device: torch.device, tensors: list[torch.Tensor | None],
                        model: torch.nn.Module | None) -> None:
    """Free the weights, KV pool and tables now, even while callers still hold the engine (an
    `LLM` kept in a variable): a second engine in the same process needs the memory."""
    torch.cuda.synchronize(device)
    if model is not None:
        tensors = [*tensors, *model.parameters(), *model.buffers()]
        tensors += [value for module in model.modules() for value in vars(module).values()
                    if isinstance(value, torch.Tensor)]  # caches such as RoPE's cos_sin
        compact = [getattr(module, "quantized", None) for module in model.modules()]
        tensors += [value for weight in compact if weight is not None  # e.g. layers.fp8's
                    for value in vars(weight).values() if isinstance(value, torch.Tensor)]
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            tensor.untyped_storage().resize_(0)
    torch.cuda.empty_cache()


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a decode step reads: every linear's as it is stored, and the LM head's
    table in the form it multiplies with at one row (GGUF blocks, int8 or bfloat16, the
    embedding's when tied), not the embedding (one row a token)."""
    total = 0
    for module in model.modules():
        if module is getattr(model, "embed_tokens", None):
            continue
        if isinstance(module, ParallelLMHead):
            table = module.blocks_head or module.int8
            total += (table.nbytes if table is not None
                      else module.weight.numel() * module.weight.element_size())
            continue
        quantized = getattr(module, "quantized", None)
        if quantized is not None:
            total += quantized.nbytes
            continue
        packed, weight = getattr(module, "packed", None), getattr(module, "weight", None)
        tensor = packed if packed is not None else weight
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total

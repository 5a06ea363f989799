"""Filling a built model with its weights: random ones (--load-format dummy) or the
checkpoint's, then each linear weight brought into the form --quantization asks for."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch

from minisgl.env import return_freed_heap
from minisgl.layers.embedding import VocabParallelEmbedding
from minisgl.layers.gguf_weight import BlockSlots, GgufBlocks
from minisgl.layers.gpu_blocks import Fp8Blocks
from minisgl.layers.quant import WeightBlocks
from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import load_dummy
from minisgl.models.gguf_blocks import PendingBlocks, file_linears, stage_block_linears
from minisgl.models.gguf_hybrid import left_in_file
from minisgl.models.hf_quant import INT4_METHODS as INT4_CHECKPOINT_METHODS
from minisgl.models.hf_quant import METHODS as CHECKPOINT_METHODS
from minisgl.models.hf_quant import QuantizedReader, QuantSpec, quant_spec
from minisgl.models.weights import gguf_file, load_config, load_safetensors

logger = logging.getLogger(__name__)


def load_weights(model: torch.nn.Module, folder: Path, arch: ModelArch, method: str,
                 dtype: torch.dtype, device: torch.device, *, load_format: str, seed: int,
                 model_path: str | None) -> None:
    """Fill `model`: random weights (`load_format` dummy, drawn from `seed`), or the converted
    checkpoint `folder`; with `method` gguf, its block-quantized linear weights (and tables)
    come from the GGUF file of `model_path` instead (never read dense); with a quantized
    checkpoint's method (awq, gptq, compressed-tensors, fp8 with a quantization_config), its
    linear weights are read as blocks (models.hf_quant). Then w8a8_int8 / fp8 quantize each layer's
    dense weight and release it."""
    if load_format == "dummy":
        load_dummy(model, arch, seed, device, dtype, int4=method == "gguf",
                   int4_groups=method in INT4_CHECKPOINT_METHODS, mxfp4=method == "mxfp4")
    else:
        with ExitStack() as files:
            staged: dict[str, PendingBlocks | None] = {}
            skip: set[str] = set()
            read: Callable[[str], GgufBlocks | Fp8Blocks] | None = None
            if method in CHECKPOINT_METHODS and (spec := quant_spec(load_config(folder))):
                reader = files.enter_context(QuantizedReader(folder, spec, device))
                staged = dict.fromkeys(_stage_checkpoint(model, reader, spec, device))
                skip, read = reader.used, reader.read
                method = "checkpoint"  # NOTE: what it left dense stays dense (not quantize_fp8)
            elif method == "gguf":
                staged, kept = stage_block_linears(model, gguf_file(model_path),
                                                   gguf_config(arch), dtype)
                if kept:
                    logger.warning("--quantization gguf: %d linear weights (%s) have no block "
                                   "kernel here and run dequantized", len(kept),
                                   ", ".join(sorted(set(kept.values()))))
            # NOTE: a converted folder lists what it left in its GGUF file: the file is read
            # (seconds, for a vocabulary's metadata) only where some of that is not staged
            left = {name for name in left_in_file(folder)
                    if name not in staged and not model.skips(name)}
            elsewhere = file_linears(gguf_file(model_path), gguf_config(arch), left) if left \
                else {}
            load_safetensors(model, folder, skip=set(staged) | skip, elsewhere=elsewhere)
            for name in list(staged):  # NOTE: one weight at a time, released once loaded
                pending = staged.pop(name)
                model.load_weight(name, pending.read() if read is None else read(name))
                _finish_when_complete(model, name, dtype, device)
                return_freed_heap()
    for module in model.modules():
        if isinstance(getattr(module, "weight", None), (WeightBlocks, BlockSlots)) or (
                getattr(module, "blocks", None) is not None
                and hasattr(module, "finish_blocks")):  # a linear's, or experts' blocks
            module.finish_blocks(dtype, device)
        elif method == "w8a8_int8" and hasattr(module, "quantize_int8"):
            module.quantize_int8()
        elif method == "fp8" and hasattr(module, "quantize_fp8"):
            module.quantize_fp8()
        if method in ("gguf", "w8a8_int8") and hasattr(module, "add_int8_copy"):  # LM head
            module.add_int8_copy(per_channel=method == "w8a8_int8")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the released dense weights: the KV pool is sized next


def gguf_config(arch: ModelArch) -> dict[str, Any]:
    """The model's config as the GGUF readers take it (head counts under their names)."""
    return {**arch.config, "num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads}


def _finish_when_complete(model: torch.nn.Module, name: str, dtype: torch.dtype,
                          device: torch.device) -> None:
    """Pack a linear's (or a layer's experts') blocks into their kernel's layout as soon as
    the last part is in, so the decoded parts (a byte a weight, larger than the packed form)
    are held for one layer, not the model."""
    target = model.weight_target(name)
    module = None if target is None else target[0]
    slots = getattr(module, "weight", None)
    if (isinstance(slots, BlockSlots) and slots.complete) or getattr(module, "blocks_complete",
                                                                     False):
        module.finish_blocks(dtype, device)


def _stage_checkpoint(model: torch.nn.Module, reader: QuantizedReader, spec: QuantSpec,
                      device: torch.device) -> list[str]:
    """The quantized weights of a checkpoint the model takes, each target told to expect
    blocks; what cannot take them is a one-line refusal."""
    staged = [name for name in reader.parts if not model.skips(name)]
    for name in staged:
        target = model.weight_target(name)
        if target is None:
            raise ValueError(f"checkpoint does not fit the model: unknown tensor {name}")
        module = target[0]
        vocabulary = isinstance(module, VocabParallelEmbedding)  # the LM head is one too
        if not hasattr(module, "expect_gguf_blocks") or (vocabulary and device.type != "cpu"):
            where = f" on {device.type}" if vocabulary else ""
            raise ValueError(f"{spec.method} checkpoint: {name} is quantized where minisgl "
                             f"reads only a dense weight{where} (quantized: linear layers and "
                             "experts)")
        module.expect_gguf_blocks()
    return staged


# a multimodal model's modules that see images (the rest is its decoder)
VISION_PARTS = ("visual", "vision", "vision_model", "connector")


def log_weight_memory(model: torch.nn.Module, method: str, dtype: torch.dtype) -> None:
    """The weights' resident size (after CPU prepacking, which may keep a second copy)."""
    modules = list(model.modules())
    compact = sum(weight.nbytes for m in modules for weight in (getattr(m, "quantized", None),
                                                                  getattr(m, "int8", None),
                                                                  getattr(m, "table_blocks", None))
                  if weight is not None)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.packed.numel() * m.packed.element_size() for m in modules
                 if getattr(m, "packed", None) is not None)
    vision = sum(tensor.numel() * tensor.element_size()
                 for name, module in model.named_children() if name in VISION_PARTS
                 for tensor in (*module.parameters(),
                                *(m.packed for m in module.modules()
                                  if getattr(m, "packed", None) is not None)))
    logger.info("weights: %.0f MB resident (%s, quantization %s: %.0f MB quantized, %.0f MB "
                "dense, %.0f MB prepacked%s)", (compact + dense + packed) / 1e6,
                str(dtype).removeprefix("torch."), method, compact / 1e6, dense / 1e6,
                packed / 1e6, f"; the vision tower {vision / 1e6:.0f} MB" if vision else "")

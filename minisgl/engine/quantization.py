"""`--quantization`: which weights stay in a compact form, and loading them.

- `gguf`: a GGUF model's Q4_0 / Q4_1 linear weights stay 4-bit as in the file (models.
  gguf_blocks, layers.quant), on CPU in bfloat16; the LM head adds an 8-bit copy for small
  decode batches (layers.embedding). The default for GGUF models where the VNNI kernel is
  built: it decodes 2x faster than `none` at one stream and no slower at 64, and prefills as
  fast (BENCHMARKS.md, "Quantized weights"). Without that kernel (torch's int4 kernel, which
  dequantizes per row, is slower than the dense GEMM from 16 rows up) it stays opt-in.
- `w8a8_int8`: any model's linear weights int8 per output feature, activations int8 per token
  and group of 32 inputs (layers.w8a8), on CPU in bfloat16 where the VNNI kernel is built:
  ~1.6x the bf16 GEMM's speed at 64 rows and up, for high-batch throughput, at the cost of
  the activations' 8 bits (BENCHMARKS.md, "W8A8"). The
  checkpoint loads dense (its peak memory is the bf16 model's), then each layer's weight is
  quantized and released; the LM head gets an int8 copy (a scale per vocabulary row) for every
  batch, its bf16 table staying for the embedding.
- `fp8`: any model's linear weights float8 e4m3 per output feature (layers.fp8), on CUDA
  (compute capability 8.9+, Triton); activations stay in the serving dtype. A bs=1 decode step
  of the 8B shape reads 8.1 GB instead of 15.1 (1.43-1.49x tok/s on an H100; slower than bf16
  from ~32 rows: BENCHMARKS.md, "GPU, second session"). As SGLang quantizes a bf16 checkpoint
  online: it loads dense, then each layer's weight is quantized and released; the LM head and
  the embedding stay in the serving dtype.
- `none`: every weight dequantized to the serving dtype.
With `--load-format dummy`, `gguf` makes the linear weights random 4-bit blocks (large shapes
in a quarter of the memory); `w8a8_int8` and `fp8` quantize random dense weights layer by layer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from minisgl.engine.config import EngineConfig
from minisgl.layers.fp8 import fp8_unavailable
from minisgl.layers.quant import WeightBlocks, vnni_kernels
from minisgl.models import ModelArch, load_dummy, load_safetensors
from minisgl.models.gguf_blocks import stage_block_linears
from minisgl.models.weights import gguf_file

logger = logging.getLogger(__name__)


def resolve_quantization(method: str | None, model: str | None, device: torch.device,
                         dtype: torch.dtype, load_format: str) -> str:
    """The method to use; ValueError (one line) if it cannot run here. The default (None) is
    gguf for a GGUF model (or the bundled one) served in bfloat16 on a CPU where the VNNI
    kernel is built, none otherwise."""
    if method is None:
        fits = (device.type == "cpu" and dtype == torch.bfloat16 and load_format != "dummy"
                and vnni_kernels() is not None and gguf_file(model) is not None)
        return "gguf" if fits else "none"
    if method == "gguf":
        if load_format != "dummy" and gguf_file(model) is None:
            raise ValueError("--quantization gguf needs a .gguf model (or the bundled one), "
                             "or --load-format dummy (random 4-bit weights)")
        if device.type != "cpu":
            raise ValueError("--quantization gguf runs on CPU only (its kernels are CPU ones); "
                             "use --quantization none on a GPU")
        if dtype != torch.bfloat16:
            raise ValueError("--quantization gguf runs with --dtype bfloat16 (its kernel has "
                             "no fast float32 path); use --quantization none for other dtypes")
    if method == "w8a8_int8":
        if device.type != "cpu" or dtype != torch.bfloat16 or vnni_kernels() is None:
            raise ValueError("--quantization w8a8_int8 runs on CPU in bfloat16 where the "
                             "AVX-512 VNNI kernel is built; use --quantization none here")
    if method == "fp8":
        why = fp8_unavailable(device)
        if why is not None:
            raise ValueError(f"--quantization fp8: {why}; use --quantization none here")
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("--quantization fp8 runs with --dtype bfloat16 or float16")
    return method


def load_weights(model: torch.nn.Module, config: EngineConfig, folder: Path, arch: ModelArch,
                 method: str, dtype: torch.dtype, device: torch.device) -> None:
    """Fill `model`: random weights, or the converted checkpoint `folder`; with `gguf`, its
    4-bit linear weights come from the GGUF file instead (never read dense)."""
    if config.load_format == "dummy":
        load_dummy(model, arch, config.seed, device, dtype, int4=method == "gguf")
    else:
        staged: dict[str, WeightBlocks] = {}
        if method == "gguf":
            heads = {"num_heads": arch.num_heads, "num_kv_heads": arch.num_kv_heads}
            staged, kept = stage_block_linears(model, gguf_file(config.model_path), heads)
            if kept:
                logger.warning("--quantization gguf: %d linear weights (%s) have no block "
                               "kernel here and run dequantized", len(kept),
                               ", ".join(sorted(set(kept.values()))))
        load_safetensors(model, folder, skip=set(staged))
        for name, blocks in staged.items():
            model.load_weight(name, blocks)
    for module in model.modules():
        if isinstance(getattr(module, "weight", None), WeightBlocks):
            module.finish_blocks(dtype)
        elif method == "w8a8_int8" and hasattr(module, "quantize_int8"):
            module.quantize_int8()
        elif method == "fp8" and hasattr(module, "quantize_fp8"):
            module.quantize_fp8()
        if method in ("gguf", "w8a8_int8") and hasattr(module, "add_int8_copy"):  # LM head
            module.add_int8_copy(per_channel=method == "w8a8_int8")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the released dense weights: the KV pool is sized next


def log_weight_memory(model: torch.nn.Module, method: str, dtype: torch.dtype) -> None:
    """The weights' resident size (after CPU prepacking, which may keep a second copy)."""
    modules = list(model.modules())
    compact = sum(weight.nbytes for m in modules for weight in (getattr(m, "quantized", None),
                                                                  getattr(m, "int8", None))
                  if weight is not None)
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(m.packed.numel() * m.packed.element_size() for m in modules
                 if getattr(m, "packed", None) is not None)
    logger.info("weights: %.0f MB resident (%s, quantization %s: %.0f MB quantized, %.0f MB "
                "dense, %.0f MB prepacked)", (compact + dense + packed) / 1e6,
                str(dtype).removeprefix("torch."), method, compact / 1e6, dense / 1e6,
                packed / 1e6)

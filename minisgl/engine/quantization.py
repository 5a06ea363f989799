"""`--quantization`: which weights stay in a compact form, and where each method can run (the
loading itself: models.loader).

- `gguf`: a GGUF model's block-quantized linear weights stay in their blocks as in the file
  (models.gguf_blocks): Q4_0 / Q4_1 / Q8_0 on the AVX-512 VNNI kernel in bfloat16 (layers.
  quant; the LM head adds an 8-bit copy for small decode batches, layers.embedding); every
  other type the AVX2 kernel takes (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; all of them, with the
  embedding / LM head table, on a CPU without VNNI or in float32) on that one (layers.
  gguf_weight). The default for GGUF models where a kernel runs them at least as precisely as
  the serving dtype: bfloat16 with the VNNI kernel, or `--dtype auto` in float32 (a CPU with
  AVX2 only) with the AVX2 kernel; both decode faster than `none` (BENCHMARKS.md, "Quantized
  weights", "The AVX2 default"). An explicit `--dtype float32` keeps `none`: the kernels'
  ~15-bit activations are less precise than float32.
- `w8a8_int8`: any model's linear weights int8 per output feature, activations int8 per token
  and group of 32 inputs (layers.w8a8), on CPU in bfloat16 where the VNNI kernel is built: for
  high-batch throughput, at the cost of the activations' 8 bits (BENCHMARKS.md, "W8A8"). The
  checkpoint loads dense (its peak memory is the bf16 model's), then each layer's weight is
  quantized and released; the LM head gets an int8 copy (a scale per vocabulary row) for every
  batch, its bf16 table staying for the embedding.
- `fp8`: any model's linear weights float8 e4m3 per output feature (layers.fp8), on CUDA
  (compute capability 8.9+, Triton); activations stay in the serving dtype. It halves the
  bytes a small decode batch reads, for decode speed at low batch sizes (BENCHMARKS.md, "GPU
  (H100 / H200)"). As SGLang quantizes a bf16 checkpoint online: it loads dense, then each
  layer's weight is quantized and released; the LM head and the embedding stay in the serving
  dtype.
- `awq`, `gptq`, `compressed-tensors` (int4), `fp8` and `mxfp4` checkpoints (config.json's
  quantization_config; the method is then the checkpoint's): linear weights read as blocks
  for the AVX2 kernel on CPU (models.hf_quant), or kept as stored for the Triton kernels on
  CUDA (layers.gpu_blocks: int4 from compute capability 8.0, fp8 from 8.9; mxfp4 there is
  dequantized).
- `none`: every weight dequantized to the serving dtype.
With `--load-format dummy`, `gguf` makes the linear weights random 4-bit blocks (large shapes
in a quarter of the memory), `awq` / `gptq` / `compressed-tensors` random int4 groups (on
CUDA), `mxfp4` random MXFP4 experts (gpt-oss); `w8a8_int8` and `fp8` quantize random dense
weights layer by layer.
"""

from __future__ import annotations

import torch

from minisgl.layers.fp8 import MIN_CAPABILITY, fp8_unavailable
from minisgl.layers.gguf_weight import block_kernels
from minisgl.layers.quant import vnni_kernels
from minisgl.models.hf_quant import INT4_METHODS, quant_spec
from minisgl.models.weights import gguf_file, load_config, resolve_model_path

INT4_MIN_CAPABILITY = (8, 0)  # bfloat16 tensor cores (Ampere)


def resolve_quantization(method: str | None, model: str | None, device: torch.device,
                         dtype: torch.dtype, load_format: str, dtype_chosen: bool = True) -> str:
    """The method to use; ValueError (one line) if it cannot run here. A quantized checkpoint
    (its config's quantization_config) takes its own method. Otherwise the default (None) is
    gguf for a GGUF model (or the bundled one) on CPU served in bfloat16 where the VNNI kernel
    is built, or in float32 that `--dtype auto` picked (`dtype_chosen` False) where the AVX2
    kernel is; none otherwise."""
    spec = None if load_format == "dummy" or gguf_file(model) is not None else quant_spec(
        load_config(resolve_model_path(model)))
    if spec is not None:
        if method not in (None, spec.method):
            raise ValueError(f"the checkpoint is quantized ({spec.method}): --quantization "
                             f"{method} cannot load it; leave it unset or give {spec.method}")
        why = _checkpoint_unavailable(spec.method, device, dtype)
        if why is not None:
            raise ValueError(f"{spec.method} checkpoints {why}")
        return spec.method
    if method in INT4_METHODS:
        if load_format == "dummy" and device.type == "cuda":
            why = _checkpoint_unavailable(method, device, dtype)
            if why is not None:
                raise ValueError(f"--quantization {method}: {why}")
            return method  # random int4 groups in the checkpoint's form (models.dummy_weights)
        raise ValueError(f"--quantization {method} loads checkpoints quantized so (config.json's "
                         "quantization_config), or random weights on CUDA (--load-format "
                         "dummy); this model has none")
    if method == "mxfp4":
        if load_format != "dummy":
            raise ValueError("--quantization mxfp4 loads checkpoints quantized so (gpt-oss's "
                             "released ones), or random weights (--load-format dummy); this "
                             "model has none")
        why = _checkpoint_unavailable(method, device, dtype)
        if why is not None:
            raise ValueError(f"--quantization mxfp4: {why}")
        return method
    if method is None:
        if device.type != "cpu" or load_format == "dummy" or gguf_file(model) is None:
            return "none"  # NOTE: before the kernel checks, which build the CPU kernels
        if dtype == torch.bfloat16:
            return "gguf" if vnni_kernels() is not None else "none"
        fits = dtype == torch.float32 and not dtype_chosen and block_kernels() is not None
        return "gguf" if fits else "none"
    if method == "gguf":
        if load_format != "dummy" and gguf_file(model) is None:
            raise ValueError("--quantization gguf needs a .gguf model (or the bundled one), "
                             "or --load-format dummy (random 4-bit weights)")
        if device.type != "cpu":
            raise ValueError("--quantization gguf runs on CPU only (its kernels are CPU ones); "
                             "use --quantization none on a GPU")
        if dtype != torch.bfloat16 and not (dtype == torch.float32 and block_kernels()):
            raise ValueError("--quantization gguf runs with --dtype bfloat16, or float32 where "
                             "the AVX2 block kernel is built; use --quantization none for other "
                             "dtypes")
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


def check_int8_activations(wanted: bool, method: str, device: torch.device) -> int:
    """The int8 terms a quantized weight's activations take on CPU (--cpu-int8-activations:
    1, else 2); ValueError where the flag would change nothing it claims to."""
    if not wanted:
        return 2
    if device.type != "cpu":
        raise ValueError("--cpu-int8-activations is for the CPU kernels; on a GPU the "
                         "activations stay in --dtype")
    if method == "none":
        raise ValueError("--cpu-int8-activations applies to quantized weights (--quantization "
                         "gguf, w8a8_int8 or a quantized checkpoint); with none every linear "
                         "runs dense")
    kernels = block_kernels()
    if kernels is None or not kernels.block_kernel_vnni():
        raise ValueError("--cpu-int8-activations needs a CPU with AVX-512 VNNI (without it "
                         "the block kernel multiplies int16 activations)")
    return 1


def _checkpoint_unavailable(method: str, device: torch.device, dtype: torch.dtype
                            ) -> str | None:
    """Why a quantized checkpoint cannot run on `device` in `dtype` (the end of a sentence
    that starts with its method), or None."""
    if device.type == "cpu":
        if block_kernels() is None:
            return "run on CPU where the AVX2 block kernel is built"
        if dtype not in (torch.float32, torch.bfloat16):
            return "run on CPU with --dtype float32 or bfloat16"
        return None
    if dtype not in (torch.bfloat16, torch.float16):
        return "run on a GPU with --dtype bfloat16 or float16"
    why = fp8_unavailable(device, MIN_CAPABILITY if method == "fp8" else INT4_MIN_CAPABILITY)
    return None if why is None else f"cannot run here: {why}"

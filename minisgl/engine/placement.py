"""Where and in what precision an engine runs: its device, its dtype, and whether a
tensor-parallel size splits the model evenly."""

from __future__ import annotations

import torch

from minisgl.kernels import cpu_kernels
from minisgl.layers.linear import native_cpu_gemm
from minisgl.models import ModelArch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16, except on a CPU without native bfloat16 GEMMs (no AVX-512 BF16 /
    AMX), where bfloat16 would run several times slower than float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu" and not native_cpu_gemm(torch.bfloat16):
        return torch.float32
    return torch.bfloat16


KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype as the pages' dtype (a resolved name, torch's, maps to itself)."""
    if name == "auto":
        return dtype
    chosen = KV_CACHE_DTYPES.get(name) or getattr(torch, name)
    if chosen.is_floating_point and chosen.itemsize > 1 and chosen != dtype:
        raise ValueError(f"--kv-cache-dtype {name} with --dtype {str(dtype).removeprefix('torch.')}"
                         ": 16-bit pages hold the compute dtype; use auto, int8 or fp8_e4m3")
    if chosen == torch.int8 and device.type != "cpu":
        raise ValueError("--kv-cache-dtype int8 is the CPU's 8-bit KV format; on CUDA use "
                         "fp8_e4m3 or fp8_e5m2 (FlashInfer's 8-bit KV)")
    return chosen


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def check_tp_size(arch: ModelArch, size: int, model_name: str) -> None:
    """Refuse a tensor-parallel size that cannot give every rank an equal share of the heads
    (KV heads may instead be replicated: size a multiple of them) and of the MLP."""
    experts = arch.moe.intermediate_size if arch.moe is not None else arch.intermediate_size

    def fits(n: int) -> bool:
        kv = arch.num_kv_heads
        return (arch.num_heads % n == 0 and (kv % n == 0 if kv >= n else n % kv == 0)
                and arch.intermediate_size % n == 0 and experts % n == 0)

    if fits(size):
        return
    parts = [f"{arch.num_heads} attention heads", f"{arch.num_kv_heads} KV heads",
             f"MLP width {arch.intermediate_size}"]
    if arch.moe is not None:
        parts.append(f"expert width {experts}")
    sizes = ", ".join(str(n) for n in range(1, arch.num_heads + 1) if fits(n))
    raise ValueError(f"--tp-size {size} cannot split {model_name} evenly ({', '.join(parts)}); "
                     f"tensor-parallel sizes that fit this model: {sizes}")


def check_hybrid(arch: ModelArch, tp_size: int, ssm_dtype: str, device: torch.device,
                 dtype: torch.dtype) -> None:
    """Refuse, in one line, what a hybrid model (recurrent states beside KV) does not run
    with: bfloat16 states where the CPU kernels do not run the linear layers (the torch forms
    update their states in float32), and linear-layer heads that do not split over the
    ranks."""
    if ssm_dtype != "float32" and (device.type != "cpu" or cpu_kernels() is None
                                   or dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"--mamba-ssm-dtype {ssm_dtype} runs on the CPU kernels only (a CPU, "
                         "--dtype float32 or bfloat16); here the states stay float32")
    if tp_size == 1:
        return
    assert arch.linear is not None
    arch.linear.split(tp_size)

"""Linear layers sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output features across ranks; row-parallel layers split the
input features and all-reduce the partial sums. Each module knows how to copy its own shard of
a checkpoint tensor (`load`), so a rank never materialises another rank's weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernels import cpu_kernels
from minisgl.layers.base import Layer
from minisgl.layers.fp8 import Fp8ChannelWeight
from minisgl.layers.gguf_weight import BlockSlots
from minisgl.layers.gpu_blocks import finished_weight
from minisgl.layers.lora import LoraSlots
from minisgl.layers.quant import WeightBlocks, BlockWeight, block_weight
from minisgl.layers.shard import copy_into, read_all, read_cols, read_part_rows, read_rows
from minisgl.layers.w8a8 import Int8ChannelWeight, fits_int8


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


class _Linear(Layer):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.quantized: BlockWeight | None = None  # any compact form (layers.quant, w8a8, fp8)
        self.lora: LoraSlots | None = None  # --enable-lora: the adapters' terms (layers.lora)

    def expect_blocks(self, bits: int = 4) -> None:
        """The checkpoint gives this layer 4- or 8-bit blocks (layers.quant): load them in
        place of the weight, which is never filled (so never resident), then `finish_blocks`."""
        out_features, in_features = self.weight.shape
        del self.weight
        # NOTE: the loaders slice it like the dense weight
        self.weight = WeightBlocks.empty(out_features, in_features, bits)

    def expect_gguf_blocks(self) -> None:
        """As expect_blocks, for GGUF blocks of any types the AVX2 kernel runs
        (layers.gguf_weight), one type per part (q / k / v, gate / up) if need be."""
        out_features, in_features = self.weight.shape
        del self.weight
        self.weight = BlockSlots(out_features, in_features)

    def finish_blocks(self, dtype: torch.dtype, device: torch.device) -> None:
        if isinstance(self.weight, BlockSlots):
            self.quantized = finished_weight(self.weight, device)
        else:
            self.quantized = block_weight(self.weight, dtype)
        self.weight = None

    def quantize_int8(self) -> None:
        """--quantization w8a8_int8: the loaded weight becomes int8 per output feature
        (layers.w8a8) and is released; a shape the kernel does not take stays dense."""
        if fits_int8(self.weight):
            self.quantized = Int8ChannelWeight(self.weight.data)
            self.weight = None

    def quantize_fp8(self) -> None:
        """--quantization fp8 (CUDA): the loaded weight becomes float8 per output feature
        (layers.fp8) and is released."""
        self.quantized = Fp8ChannelWeight(self.weight.data)
        self.weight = None

    def prepack_for_cpu(self) -> None:
        """Reorder the weight into oneDNN's blocked layout (after loading), which bf16 GEMMs on
        CPU run faster from (BENCHMARKS.md). The plain weight is released."""
        if self.quantized is not None:
            return
        self.packed = pack_weight(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None:
            out = self.quantized.matmul(x)
            return out if bias is None else out + bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        if 1 < x.shape[0] <= FEW_ROWS and x.dim() == 2 and x.device.type == "cpu":
            out = few_rows_matmul(x, self.weight)
            if out is not None:
                return out if bias is None else out + bias
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora.add(x, out)

    def output_rows(self, shard_id: Any) -> tuple[int, int, int]:
        """Where part `shard_id`'s output rows go in this rank's shard and come from in the
        checkpoint's tensor: (offset here, first source row, rows)."""
        raise NotImplementedError

    def own_rows(self, full: torch.Tensor, shard_id: Any = None) -> torch.Tensor:
        """This rank's rows of a tensor over part `shard_id`'s full output (a LoRA B), cut
        as `load` cuts the weight."""
        _, start, size = self.output_rows(shard_id)
        return full[start:start + size]


# Up to this many rows (a verify step of speculative decoding, a small decode batch) a CPU
# linear runs our kernel, which streams the weight once for all of them: the GEMM library's
# kernels for 2-8 rows read it at a fraction of the bandwidth of their one-row kernel
# (BENCHMARKS.md, "Speculative decoding").
FEW_ROWS = 8


def few_rows_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ weight.T by kernels/csrc/expert_matmul.cpp (one group), or None where it does not
    run (no compiled kernels, another dtype)."""
    kernels = cpu_kernels()
    if kernels is None or x.dtype not in (torch.float32, torch.bfloat16) or (
            weight.dtype != x.dtype) or (x.dtype == torch.bfloat16 and x.shape[0] < 3):
        return None  # NOTE: unpacked bf16 GEMMs of 1-2 rows are faster (BENCHMARKS.md)
    ends = torch.tensor([x.shape[0]], dtype=torch.int32)
    return kernels.expert_matmul(x, weight.unsqueeze(0), ends)


def native_cpu_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies `dtype` natively on this CPU (AVX-512 BF16 / FP16, AMX).
    Without it a half-precision GEMM converts on the fly and runs several times slower than
    float32 (BENCHMARKS.md), and the blocked weight layout cannot be made at all."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
            and native_cpu_gemm(weight.dtype))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)  # 64: the batch to tune for


class DenseLinear(Layer):
    """A plain linear of a vision tower, under the checkpoint's names (`weight`, `bias`): whole
    on every rank, never quantized, never a LoRA target; on CPU its weight is prepacked as the
    decoder's are. Takes inputs of any leading shape."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias
                     else None)
        self.packed: torch.Tensor | None = None

    def prepack_for_cpu(self) -> None:
        self.packed = pack_weight(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


class ReplicatedLinear(_Linear):
    """A linear every rank holds whole (a small projection beside the sharded ones)."""

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        copy_into(getattr(self, name).data, read_rows(source, 0, self.out_features), name)

    def output_rows(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, 0, self.out_features


class ColumnParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_info()
        self.shard = divide(out_features, tp.size, "output features")
        super().__init__(in_features, self.shard, bias)

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        _, start, size = self.output_rows(shard_id)
        copy_into(getattr(self, name).data, read_rows(source, start, size), name)

    def output_rows(self, shard_id: Any) -> tuple[int, int, int]:
        return 0, get_tp_info().rank * self.shard, self.shard


class PartedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel projection whose checkpoint tensor stacks several parts (a fused q, k
    and v), each split over the ranks: a rank holds its share of every part, in order."""

    def __init__(self, in_features: int, parts: list[int], bias: bool = False) -> None:
        self.parts = parts
        super().__init__(in_features, sum(parts), bias)

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        tp = get_tp_info()
        if tp.size == 1:
            return super().load(name, source, shard_id)
        copy_into(getattr(self, name).data, self.own_rows(source), name)

    def own_rows(self, full: Any, shard_id: Any = None) -> torch.Tensor:
        tp = get_tp_info()
        return read_part_rows(full, self.parts, tp.rank, tp.size)


class PartedParameters(Layer):
    """Parameters split over the ranks by their first dimension, which stacks `parts` (a
    convolution over q, k and v; per-head vectors: one part): each rank holds its share of
    every part. `shapes`: the parameters' full shapes."""

    def __init__(self, parts: list[int], **shapes: tuple[int, ...]) -> None:
        super().__init__()
        tp = get_tp_info()
        self.parts = parts
        local = sum(divide(part, tp.size, "channels") for part in parts)
        for name, shape in shapes.items():
            assert shape[0] == sum(parts)
            setattr(self, name, nn.Parameter(torch.empty(local, *shape[1:]),
                                             requires_grad=False))

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        tp = get_tp_info()
        copy_into(getattr(self, name).data,
                  read_part_rows(source, self.parts, tp.rank, tp.size), name)


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel projections of one input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False) -> None:
        tp = get_tp_info()
        self.shards = [divide(n, tp.size, "output features") for n in out_features]
        super().__init__(in_features, sum(self.shards), bias)

    def load(self, name: str, source: Any, shard_id: int) -> None:
        offset, start, size = self.output_rows(shard_id)
        part = getattr(self, name).data.narrow(0, offset, size)
        copy_into(part, read_rows(source, start, size), name)

    def output_rows(self, shard_id: int) -> tuple[int, int, int]:
        size = self.shards[shard_id]
        return sum(self.shards[:shard_id]), get_tp_info().rank * size, size


class QKVParallelLinear(_Linear):
    """Merged q/k/v projection. Query heads are split across ranks; when there are fewer KV
    heads than ranks, each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, values: bool = True) -> None:
        tp = get_tp_info()
        self.values = values  # False: no v rows, the keys serve as values (split gives k twice)
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "KV heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            divide(tp.size, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden, self.q_size + (2 if values else 1) * self.kv_size, bias)

    def load(self, name: str, source: Any, shard_id: str) -> None:
        offset, start, size = self.output_rows(shard_id)
        part = getattr(self, name).data.narrow(0, offset, size)
        copy_into(part, read_rows(source, start, size), f"{name}[{shard_id}]")

    def output_rows(self, shard_id: str) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, get_tp_info().rank * self.q_size, self.q_size
        offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
        return offset, self.kv_head_start * self.head_dim, self.kv_size

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.values:
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            return q, k, k
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_info()
        self.shard = divide(in_features, tp.size, "input features")
        super().__init__(self.shard, out_features, bias)

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        if name == "bias":
            copy_into(self.bias.data, read_all(source), name)
        else:
            copy_into(self.weight.data, read_cols(source, *self.input_cols()), name)

    def input_cols(self) -> tuple[int, int]:
        """(first source column, columns) of this rank's input features."""
        return get_tp_info().rank * self.shard, self.shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x, None)
        if self.lora is not None:  # NOTE: x_shard A_shard^T B^T sums over ranks to x A^T B^T
            partial = self.lora.add(x, partial)
        out = all_reduce(partial)
        # NOTE: the bias is added once, after the reduction, not once per rank.
        return out + self.bias if self.bias is not None else out

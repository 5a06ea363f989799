"""Mixture of experts: a top-k softmax router and the experts run as grouped matmuls.

A layer's token rows are sorted by the expert each (row, choice) goes to, so every expert's
rows are contiguous; one grouped matmul (grouped_matmul) then multiplies each group by its
expert's weight (gate/up, then down; with --enable-lora each pair's adapter term added to
both, layers.lora.ExpertLora), and the outputs, scaled by the routing weights, are summed
back into their rows. Tensor parallelism splits every expert's intermediate dimension
(gate/up rows, down columns), as it splits a dense MLP; the router is replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kernels import cpu_kernels
from minisgl.layers.activation import SiluAndMul
from minisgl.layers.base import Layer
from minisgl.layers.fp8 import Fp8ChannelWeight
from minisgl.layers.gguf_weight import BlockSlots, GgufBlocks, GroupedGgufWeights
from minisgl.layers.gpu_blocks import Fp8Blocks, finished_weight
from minisgl.layers.linear import divide
from minisgl.layers.lora import ExpertLora, LoraStep
from minisgl.layers.quant import WeightBlocks, block_weight
from minisgl.layers.shard import copy_into, read_all, read_cols, read_rows
from minisgl.layers.w8a8 import Int8ChannelWeight, fits_int8


class TopKRouter(Layer):
    """Softmax over the experts' logits (float32; a bias on them: gpt-oss's), the top k,
    optionally renormalised to sum to one (Mixtral always; Qwen3-MoE where norm_topk_prob says
    so)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 renormalize: bool, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias
                     else None)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight, self.bias).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x grouped by expert (group e ends at row ends[e]) times each expert's weight
    [E, out, in]: on CPU our kernel (kernels/csrc/expert_matmul.cpp: it streams each weight
    once at the few rows a decode step gives an expert), else torch's grouped matmul."""
    kernels = cpu_kernels() if x.device.type == "cpu" else None
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16):
        return kernels.expert_matmul(x, weight, ends)
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes x: any dtype on CPU, bfloat16 on Hopper and newer
    (elsewhere the experts loop, one matmul per expert with rows)."""
    if x.device.type == "cpu":
        return True
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


def stack_rows(top: WeightBlocks, bottom: WeightBlocks) -> WeightBlocks:
    return WeightBlocks(torch.cat([top.codes, bottom.codes]), torch.cat([top.scales,
                        bottom.scales]), torch.cat([top.zeros, bottom.zeros]), top.bits)


def joined(parts: list[Any], dtype: torch.dtype, device: torch.device) -> Any:
    """Blocks of one expert's weight, given by row ranges in order, as one compact weight."""
    if isinstance(parts[0], WeightBlocks):
        return block_weight(stack_rows(*parts) if len(parts) > 1 else parts[0], dtype)
    slots = BlockSlots(sum(p.shape[0] for p in parts), parts[0].shape[1])
    start = 0
    for part in parts:
        slots.narrow(0, start, part.shape[0]).copy_(part)
        start += part.shape[0]
    return finished_weight(slots, device)


class QuantizedExperts:
    """Per expert, its (gate_up, down) weights in a compact form (layers.w8a8, layers.fp8,
    layers.quant's blocks)."""

    def __init__(self, parts: list[tuple[Any, Any]]) -> None:
        self.parts = parts
        # each part's experts as one kernel call, where their forms allow (GGUF blocks)
        self.grouped = {name: GroupedGgufWeights.of([p[i] for p in parts])
                        for i, name in enumerate(("gate_up", "down"))}

    @property
    def nbytes(self) -> int:
        return sum(gate_up.nbytes + down.nbytes for gate_up, down in self.parts)


class Experts(Layer):
    """Every expert's gate/up ([E, 2 * I / tp, H]) and down ([E, H, I / tp]) weights. With an
    `act` of its own an expert has no gate (unless `gated`: the act takes gate and up, as
    SiluAndMul does): `gate_up` holds its up rows alone ([E, I / tp, H]) and act(up x) feeds
    down. With `bias`, each expert adds its own to gate/up's output and to down's."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act: Layer | None = None, gated: bool | None = None, bias: bool = False
                 ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.shard = divide(intermediate_size, tp.size, "expert intermediate size")
        self.rank_start = tp.rank * self.shard  # this rank's first intermediate feature
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.gated = act is None if gated is None else gated
        self.gate_up_width = (2 if self.gated else 1) * self.shard
        self.gate_up = nn.Parameter(torch.empty(num_experts, self.gate_up_width, hidden_size),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard),
                                 requires_grad=False)
        self.act = act or SiluAndMul()
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, self.gate_up_width),
                                             requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size),
                                          requires_grad=False)
        self.quantized: QuantizedExperts | None = None  # --quantization w8a8_int8/fp8/gguf
        # --quantization gguf: per part (gate, up, down), each expert's blocks as loaded
        self.blocks: dict[str, list[WeightBlocks | None]] | None = None
        self.lora: ExpertLora | None = None  # --enable-lora: the adapters' terms

    def load(self, expert: int | None, part: str, source: Any) -> None:
        """One checkpoint tensor: `part` gate / up / down of `expert`, or of every expert at once
        (expert None: a [E, ...] tensor; part gate_up is gate and up stacked); or every
        expert's bias of a part: gate_up_bias ([E, 2 I]: gate's then up's), gate_bias,
        up_bias ([E, I]) or down_bias ([E, H])."""
        rank_start = get_tp_info().rank * self.shard
        if part.endswith("_bias"):
            return self._load_bias(part, read_all(source))

        def shard(blocks: Any) -> Any:
            return (read_cols(blocks, rank_start, self.shard) if part == "down"
                    else read_rows(blocks, rank_start, self.shard))

        if self.blocks is not None:
            if isinstance(source, list) and part == "gate_up":  # gate's rows, then up's
                for e, blocks in enumerate(source):
                    self.blocks["gate"][e] = read_rows(blocks, rank_start, self.shard)
                    self.blocks["up"][e] = read_rows(blocks, self.intermediate_size + rank_start,
                                                     self.shard)
            elif isinstance(source, list):  # a GGUF file's stacked blocks, one per expert
                for e, blocks in enumerate(source):
                    self.blocks[part][e] = shard(blocks)
            elif isinstance(source, (GgufBlocks, Fp8Blocks)) and expert is not None:
                self.blocks[part][expert] = shard(source)  # a quantized checkpoint's
            # else: the converted folder's dense copy of what the blocks hold
            return
        if expert is None:
            full = read_all(source)
            for e in range(self.num_experts):
                if part == "gate_up":
                    half = full.shape[1] // 2
                    self.load(e, "gate", full[e, :half])
                    self.load(e, "up", full[e, half:])
                else:
                    self.load(e, part, full[e])
            return
        if part == "down":
            copy_into(self.down.data[expert], read_cols(source, rank_start, self.shard),
                      f"experts.{expert}.down")
        else:
            start = self.shard if part == "up" and self.gated else 0
            rows = self.gate_up.data[expert].narrow(0, start, self.shard)
            copy_into(rows, read_rows(source, rank_start, self.shard), f"experts.{expert}.{part}")

    def _load_bias(self, part: str, full: torch.Tensor) -> None:
        tp = get_tp_info()
        if part == "down_bias":  # NOTE: down's outputs are summed over the ranks: added once
            copy_into(self.down_bias.data, full if tp.rank == 0 else torch.zeros_like(full),
                      part)
            return
        mine = slice(tp.rank * self.shard, (tp.rank + 1) * self.shard)
        if part == "gate_up_bias":
            rows = full.view(self.num_experts, 2 if self.gated else 1, -1)[:, :, mine]
            copy_into(self.gate_up_bias.data, rows.reshape(self.num_experts, -1), part)
            return
        start = self.shard if part == "up_bias" and self.gated else 0
        copy_into(self.gate_up_bias.data[:, start:start + self.shard], full[:, mine], part)

    def expect_blocks(self, bits: int = 4) -> None:
        """--quantization gguf: the experts' weights come as blocks (models.gguf_blocks), one
        per expert, never dense: the dense parameters are released, `finish_blocks` follows.
        A quantized checkpoint's experts (models.hf_quant) come so too (`expect_gguf_blocks`),
        one tensor per expert and part."""
        parts = ("gate", "up", "down") if self.gated else ("up", "down")
        self.blocks = {part: [None] * self.num_experts for part in parts}
        self.gate_up = self.down = None

    @property
    def blocks_complete(self) -> bool:
        """Every expert's every part has come as blocks (`finish_blocks` may pack them)."""
        return self.blocks is not None and all(b is not None for part in self.blocks.values()
                                               for b in part)

    def expect_gguf_blocks(self) -> None:
        if self.blocks is None:
            self.expect_blocks()

    def finish_blocks(self, dtype: torch.dtype, device: torch.device) -> None:
        """Each expert's gate and up blocks (rows; ungated: up alone) as one weight, and its
        down blocks: GGUF Q4 blocks in the form layers.quant runs them, a checkpoint's in the
        form its kernel runs on `device` (layers.gguf_weight on CPU, layers.gpu_blocks on
        CUDA)."""
        missing = [f"{part} of expert {e}" for part, per_expert in self.blocks.items()
                   for e, blocks in enumerate(per_expert) if blocks is None]
        if missing:
            raise ValueError(f"quantized experts: no weights for {', '.join(missing[:4])}")
        # per expert its gate and up (or up alone: an ungated MLP) as one weight, and down
        firsts = zip(*(self.blocks[part] for part in self.blocks if part != "down"))
        self.quantized = QuantizedExperts([
            (joined(list(first), dtype, device), joined([d], dtype, device))
            for first, d in zip(firsts, self.blocks["down"])])
        self.blocks = None

    def quantize_int8(self) -> None:
        if fits_int8(self.gate_up.data[0]) and fits_int8(self.down.data[0]):
            self._quantize(Int8ChannelWeight)

    def quantize_fp8(self) -> None:
        self._quantize(Fp8ChannelWeight)

    def _quantize(self, form: Any) -> None:
        self.quantized = QuantizedExperts([(form(self.gate_up.data[e]), form(self.down.data[e]))
                                           for e in range(self.num_experts)])
        self.gate_up = self.down = None

    def per_expert(self, x: torch.Tensor) -> bool:
        """Whether activations like x run one matmul per expert (see _per_expert), which reads
        the row counts back to the host: a CUDA graph cannot capture that."""
        return self.quantized is not None or not grouped_mm_runs(x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """sum over the k choices of weight * expert(x), per row; this rank's partial sums."""
        top_k = ids.shape[1]
        choices = ids.flatten()
        order = torch.argsort(choices, stable=True)  # (row, choice) pairs grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, choices, torch.ones_like(choices, dtype=torch.int32))
        rows = order // top_k
        grouped = x.index_select(0, rows)
        lora = (None if self.lora is None
                else self.lora.pair_step(rows, choices.index_select(0, order)))
        if not self.per_expert(x):
            ends = counts.cumsum(0, dtype=torch.int32)

            def matmul(h: torch.Tensor, part: str) -> torch.Tensor:
                return grouped_matmul(h, getattr(self, part), ends)
        else:
            host_counts = counts.tolist()

            def matmul(h: torch.Tensor, part: str) -> torch.Tensor:
                return self._per_expert(h, host_counts, part)
        sorted_ids = choices.index_select(0, order) if self.down_bias is not None else None
        h = self.act(self._add_lora("gate_up", grouped, self._biased(
            matmul(grouped, "gate_up"), self.gate_up_bias, sorted_ids), lora))
        out = self._add_lora("down", h, self._biased(matmul(h, "down"), self.down_bias,
                                                     sorted_ids), lora)
        out = out * weights.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, rows, out)

    @staticmethod
    def _biased(out: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None
                ) -> torch.Tensor:
        """`out` (rows grouped by expert; ids: each row's expert) plus its expert's bias."""
        return out if bias is None else out + bias.index_select(0, ids)

    def _add_lora(self, part: str, x: torch.Tensor, out: torch.Tensor, step: LoraStep | None
                  ) -> torch.Tensor:
        return out if step is None else self.lora.add(part, x, out, step)

    def _per_expert(self, grouped: torch.Tensor, counts: list[int], part: str) -> torch.Tensor:
        """One grouped matmul (`part` gate_up or down) of quantized weights, or on a device
        without a grouped matmul: GGUF blocks as one kernel call for every expert
        (GroupedGgufWeights), the others as one matmul per expert that has rows."""
        grouped_weights = self.quantized.grouped[part] if self.quantized is not None else None
        if grouped_weights is not None:
            out = grouped_weights.matmul(grouped, counts)
            if out is not None:
                return out
        width = self.gate_up_width if part == "gate_up" else self.hidden_size
        out = grouped.new_empty(grouped.shape[0], width)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = grouped[start:start + count]
            if self.quantized is not None:
                weight = self.quantized.parts[expert][0 if part == "gate_up" else 1]
                out[start:start + count] = weight.matmul(rows)
            else:
                out[start:start + count] = F.linear(rows, getattr(self, part)[expert])
            start += count
        return out


class SparseMoE(Layer):
    """The MoE block that stands where a dense MLP would: router (`gate`) and `experts`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return all_reduce(self.experts(x, weights, ids))


def syncs_on_host(model: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether some of `model`'s experts would read row counts back to the host at `dtype`."""
    probe = torch.empty(0, dtype=dtype, device=device)
    return any(isinstance(m, Experts) and m.per_expert(probe) for m in model.modules())

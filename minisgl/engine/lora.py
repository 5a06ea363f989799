"""--enable-lora on one rank: the model's LoRA-capable linears with their slot buffers
(layers.lora), the adapters read from disk (this rank's shards), and each step's part: load the
adapters the scheduler put into slots, then the token -> slot layout every LoRA linear reads.

Slot loads travel with the step that first needs them and run on the engine's thread or stream
just before it, so they follow every step launched earlier (which may still use the slot's old
adapter) and precede every later one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
from torch import nn

from minisgl.core import Batch
from minisgl.distributed.context import TPInfo, tp_context
from minisgl.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear, RowParallelLinear)
from minisgl.kernels import cpu_kernels
from minisgl.layers.lora import LoraContext, LoraSlots, LoraStep
from minisgl.models.peft import AdapterError, PeftAdapter, read_adapter

logger = logging.getLogger(__name__)

LINEARS = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
           RowParallelLinear)
# an adapter slot load: (slot, adapter uid, its folder)
SlotLoad = tuple[int, int, str]


@dataclass(frozen=True)
class LoraSettings:
    slots: int  # --max-loras-per-batch
    rank: int  # --max-lora-rank
    targets: frozenset[str]  # --lora-target-modules (PEFT leaf names: q_proj, ...); empty: all
    cached: int  # adapters a tensor-parallel worker keeps read (--max-loaded-loras)


Shard = tuple[LoraSlots, int, torch.Tensor, torch.Tensor]  # buffers, part, A, B (this rank)


def lora_capable(model: nn.Module) -> dict[str, list[tuple[str, object]]]:
    """Module path -> the PEFT leaf names it computes, as (leaf, shard id) in output order,
    for every linear a LoRA adapter may target (q/k/v/o, gate/up/down)."""
    stacked = getattr(model, "STACKED", {})
    found = {}
    for path, module in model.named_modules():
        if not isinstance(module, LINEARS) or ".layers." not in f".{path}":
            continue
        own = path.rpartition(".")[2]
        hosted = [(leaf, sid) for leaf, (merged, sid) in stacked.items() if merged == own]
        if not hosted:
            if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
                continue  # a merged linear no checkpoint projection name maps to
            hosted = [(own, None)]
        found[path] = sorted(hosted, key=lambda h: module.output_rows(h[1])[0]
                             if h[1] is not None else 0)
    return found


class LoraModules:
    def __init__(self, model: nn.Module, settings: LoraSettings, dtype: torch.dtype,
                 device: torch.device, tp: TPInfo) -> None:
        self.model, self.settings, self.dtype, self.device = model, settings, dtype, device
        self.tp = tp  # NOTE: register() runs on any thread; the shards are this rank's
        self.context = LoraContext()
        capable = lora_capable(model)
        self.capable_targets = {leaf for hosted in capable.values() for leaf, _ in hosted}
        self.fused = getattr(model, "fused_parts", {})  # Phi-3's qkv_proj -> q/k/v parts
        self.targets = frozenset(unfused_leaves(settings.targets, self.fused)) or frozenset(
            self.capable_targets)
        unknown = self.targets - self.capable_targets
        if unknown:
            raise ValueError(f"--lora-target-modules: this model has no LoRA-capable "
                             f"{', '.join(sorted(unknown))} (it has "
                             f"{', '.join(sorted(self.capable_targets))})")
        self.buffers: list[LoraSlots] = []
        for path, hosted in capable.items():
            if not any(leaf in self.targets for leaf, _ in hosted):
                continue
            module = model.get_submodule(path)
            sizes = [module.out_features if sid is None else module.output_rows(sid)[2]
                     for _, sid in hosted]
            module.lora = LoraSlots(self.context, settings.slots, settings.rank,
                                    module.in_features, sizes, dtype, device)
            module.lora_parts = [sid for _, sid in hosted]
            self.buffers.append(module.lora)
        self.adapters: OrderedDict[int, list[Shard]] = OrderedDict()  # uid -> shards
        # NOTE: the grouped-GEMM kernel takes float32 and bfloat16 on CPU (layers.lora)
        segmented = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                     and cpu_kernels() is not None)
        self.layout = "segmented" if segmented else (
            "per_token" if device.type == "cuda" else "masked")

    def register(self, uid: int, path: str) -> PeftAdapter:
        """Read and check an adapter (raises AdapterError); keep its shards for slot loads."""
        adapter = self._read(path)
        if adapter.rank > self.settings.rank:
            raise AdapterError(f"{path}: rank {adapter.rank} is above --max-lora-rank "
                               f"{self.settings.rank}")
        extra = adapter.targets - self.targets
        if extra:
            raise AdapterError(f"{path}: targets {', '.join(sorted(extra))}, outside "
                               f"--lora-target-modules ({', '.join(sorted(self.targets))})")
        with tp_context(self.tp, None):
            self.adapters[uid] = self._shards(adapter)
        return adapter

    def _read(self, path: str) -> PeftAdapter:
        return unfused(read_adapter(path), self.fused)

    def drop(self, uid: int) -> None:
        self.adapters.pop(uid, None)

    def _shards(self, adapter: PeftAdapter) -> list[Shard]:
        shards = []
        for name, (a, b) in adapter.weights.items():
            if self.model.skips(f"{name}.weight"):
                continue  # a layer past a reduced depth (json_model_override_args)
            target = self.model.weight_target(f"{name}.weight")
            module = target[0] if target is not None else None
            slots = getattr(module, "lora", None)
            if slots is None or target[2] not in module.lora_parts:
                raise AdapterError(f"{adapter.path}: {name} is not a linear layer minisgl "
                                   "applies LoRA to")
            part = module.lora_parts.index(target[2])
            if isinstance(module, RowParallelLinear):
                start, count = module.input_cols()
                a = a[:, start:start + count]
            else:
                _, start, count = module.output_rows(target[2])
                b = b[start:start + count]
            if a.shape[1] != slots.a.shape[2] or b.shape[0] != slots.parts[part]:
                raise AdapterError(f"{adapter.path}: {name} has shape {tuple(a.shape)} x "
                                   f"{tuple(b.shape)}, not this model's")
            shards.append((slots, part, a.to(self.dtype).contiguous(),
                           b.to(self.dtype).contiguous()))
        return shards

    def begin_step(self, loads: list[SlotLoad], batch: Batch) -> None:
        """On the engine's thread / stream, before the forward: fill the slots the step loads
        (a worker reads an adapter it has not seen), then set the token -> slot layout."""
        for slot, uid, path in loads:
            shards = self.adapters.get(uid)
            if shards is None:  # a tensor-parallel worker: rank 0 checked it
                shards = self.adapters[uid] = self._shards(self._read(path))
                while len(self.adapters) > self.settings.cached:
                    self.adapters.popitem(last=False)
            self.adapters.move_to_end(uid)
            for buffers in self.buffers:
                buffers.clear(slot)
            for buffers, part, a, b in shards:
                buffers.write(slot, part, a, b)
        self.context.step = lora_step(batch, self.layout, self.dtype)


def unfused_leaves(leaves: frozenset[str] | set[str], fused: dict[str, list]) -> set[str]:
    return {part for leaf in leaves for part in ([p[0] for p in fused[leaf]] if leaf in fused
                                                 else [leaf])}


def unfused(adapter: PeftAdapter, fused: dict[str, list[tuple[str, int, int]]]) -> PeftAdapter:
    """An adapter of a fused checkpoint module (Phi-3's qkv_proj: A [r, in], B [q+k+v, r]) as
    one per part sharing A, B cut by the part's rows: the same product, in the parts our merged
    linears hold (and shard)."""
    if not adapter.targets & fused.keys():
        return adapter
    weights = {}
    for name, (a, b) in adapter.weights.items():
        prefix, _, leaf = name.rpartition(".")
        parts = fused.get(leaf, [(leaf, 0, b.shape[0])])
        if b.shape[0] != sum(rows for _, _, rows in parts):
            raise AdapterError(f"{adapter.path}: {name}: lora_B has {b.shape[0]} rows, the "
                               f"model's {leaf} {sum(rows for _, _, rows in parts)}")
        for part, offset, rows in parts:
            weights[f"{prefix}.{part}"] = (a, b[offset:offset + rows])
    return replace(adapter, targets=unfused_leaves(adapter.targets, fused), weights=weights)


DEFAULT_RANK = 16
ALL_TARGETS = "all"


def lora_settings(enable: bool, paths: list[tuple[str, str, bool]], slots: int,
                  rank: int | None, targets: list[str] | None, loaded: int | None
                  ) -> LoraSettings | None:
    """The flags, with --max-lora-rank and --lora-target-modules taken from the start-up
    adapters where not given (raises AdapterError for an unreadable one)."""
    if not enable:
        return None
    adapters = [read_adapter(path) for _, path, _ in paths] if (
        rank is None or targets is None) else []
    if rank is None:
        rank = max((a.rank for a in adapters), default=DEFAULT_RANK)
    chosen = set(targets or ()) - {ALL_TARGETS}
    if targets is None:
        chosen = {leaf for a in adapters for leaf in a.targets}
    all_targets = not chosen or ALL_TARGETS in (targets or ())
    return LoraSettings(slots, rank, frozenset(chosen) if not all_targets else frozenset(),
                        loaded or 2 * slots)


# NOTE: the per-token kernels read a token's adapter once per token; past a decode batch's
# token counts (prefill) one GEMM over the step's slots (the masked layout) is the better bet.
# Decode batches always take them: the CUDA graphs replay their slots (engine.graph).
PER_TOKEN_MAX_TOKENS = 512


def lora_step(batch: Batch, layout: str, dtype: torch.dtype) -> LoraStep | None:
    """The step's token -> slot layout (layers.lora: `layout` segmented, per_token or
    masked); None when no row uses an adapter."""
    if batch.lora_slots is None:
        return None
    slots = torch.tensor(batch.lora_slots[:batch.size])
    width = int(slots.max()) + 1
    if width == 0:
        return None
    token_slots = torch.repeat_interleave(slots, torch.tensor(batch.extend_lens[:batch.size]))
    device = batch.input_positions.device
    if layout == "per_token" and (batch.is_decode
                                  or token_slots.numel() <= PER_TOKEN_MAX_TOKENS):
        return LoraStep(width, token_slots=token_slots.to(device, torch.int32))
    if layout != "segmented":
        mask = (token_slots[:, None] == torch.arange(width)).to(device, dtype)
        return LoraStep(width, mask=mask)
    order = torch.argsort(token_slots, stable=True)
    rows = order[(token_slots[order] >= 0)]
    ends = torch.bincount(token_slots[rows], minlength=width).cumsum(0).to(torch.int32)
    return LoraStep(width, rows=rows.to(device), ends=ends)

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
from minisgl.layers.lora import (ExpertLora, LoraContext, LoraSlots, LoraStep,
                                 slot_layout)
from minisgl.layers.moe import Experts
from minisgl.models.peft import (EXPERT_STACK, AdapterError, PeftAdapter, read_adapter,
                                 split_expert_stack)

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


# buffers, part (an ExpertLora's: expert, gate_up or down), A, B (this rank's)
Shard = tuple[LoraSlots | ExpertLora, int | tuple[int, str], torch.Tensor, torch.Tensor]


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
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        self.capable_targets = {leaf for hosted in capable.values() for leaf, _ in hosted} | (
            set(EXPERT_PARTS) if experts else set())
        self.fused = getattr(model, "fused_parts", {})  # Phi-3's qkv_proj -> q/k/v parts
        self.aliases = getattr(model, "lora_target_aliases", {})  # Mixtral's w1 -> gate_proj
        self.targets = frozenset(self._ours(unfused_leaves(settings.targets, self.fused))
                                 ) or frozenset(self.capable_targets)
        unknown = self.targets - self.capable_targets
        if unknown:
            raise ValueError(f"--lora-target-modules: this model has no LoRA-capable "
                             f"{', '.join(sorted(unknown))} (it has "
                             f"{', '.join(sorted(self.capable_targets))})")
        self.buffers: list[LoraSlots | ExpertLora] = []
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
        expert_parts = {EXPERT_PARTS[leaf] for leaf in self.targets & EXPERT_PARTS.keys()}
        for module in experts if expert_parts else []:
            module.lora = ExpertLora(self.context, settings.slots, settings.rank,
                                     module.num_experts, module.hidden_size, module.shard,
                                     expert_parts, dtype, device)
            self.buffers.append(module.lora)
        if experts and expert_parts:
            size = sum(t.nbytes for m in experts for t in m.lora.tensors)
            logger.info("LoRA on the experts: %.2f GiB of slot buffers (%d slots, rank %d; "
                        "--lora-target-modules without gate/up/down leaves them out)",
                        size / 2**30, settings.slots, settings.rank)
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
        adapter = unfused(read_adapter(path), self.fused)
        return replace(adapter, targets=self._ours(adapter.targets))

    def _ours(self, leaves: set[str]) -> set[str]:
        return {self.aliases.get(leaf, leaf) for leaf in leaves}

    def drop(self, uid: int) -> None:
        self.adapters.pop(uid, None)

    def _shards(self, adapter: PeftAdapter) -> list[Shard]:
        shards = []
        experts: dict[tuple[Experts, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for name, (a, b) in adapter.weights.items():
            if self.model.skips(f"{name}.weight"):
                continue  # a layer past a reduced depth (json_model_override_args)
            target = self.model.weight_target(f"{name}.weight")
            module = target[0] if target is not None else None
            slots = getattr(module, "lora", None)
            if isinstance(slots, ExpertLora) and target[2] is not None:
                if not 0 <= target[2] < module.num_experts:
                    raise AdapterError(f"{adapter.path}: {name}: the model has "
                                       f"{module.num_experts} experts")
                experts.setdefault((module, target[2]), {})[target[1]] = (a, b)
                continue
            if (slots is None or isinstance(slots, ExpertLora)
                    or target[2] not in module.lora_parts):
                raise AdapterError(f"{adapter.path}: {name} is not a linear layer minisgl "
                                   "applies LoRA to")
            part = module.lora_parts.index(target[2])
            if isinstance(module, RowParallelLinear):
                start, count = module.input_cols()
                a = a[:, start:start + count]
            else:
                b = module.own_rows(b, target[2])
            if a.shape[1] != slots.a.shape[2] or b.shape[0] != slots.parts[part]:
                raise AdapterError(f"{adapter.path}: {name} has shape {tuple(a.shape)} x "
                                   f"{tuple(b.shape)}, not this model's")
            shards.append((slots, part, a.to(self.dtype).contiguous(),
                           b.to(self.dtype).contiguous()))
        for name, (a, b) in adapter.expert_stacks.items():
            module = self._stacked_experts(adapter, name)
            if module is None:
                continue
            parameter = ("gate_up_proj" if (a.shape[1], b.shape[0]) == (
                module.hidden_size, 2 * module.intermediate_size) else "down_proj")
            per_expert = split_expert_stack(adapter, name, parameter, module.num_experts)
            for e, pair in enumerate(per_expert):
                experts.setdefault((module, e), {})[parameter.removesuffix("_proj")] = pair
        for (module, expert), parts in experts.items():
            for which, (a, b) in expert_terms(module, parts, adapter.path).items():
                shards.append((module.lora, (expert, which), a.to(self.dtype).contiguous(),
                               b.to(self.dtype).contiguous()))
        return shards

    def _stacked_experts(self, adapter: PeftAdapter, name: str) -> Experts | None:
        """The Experts module of a LoRA on stacked expert parameters (None: a layer past a
        reduced depth)."""
        experts = EXPERT_STACK.fullmatch(name)["experts"]
        if self.model.skips(f"{experts}.down_proj.weight"):
            return None
        target = self.model.weight_target(f"{experts}.down_proj.weight")
        if target is None or not isinstance(getattr(target[0], "lora", None), ExpertLora):
            raise AdapterError(f"{adapter.path}: {name} is not a mixture of experts minisgl "
                               "applies LoRA to")
        return target[0]

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


# the PEFT leaf names an expert's LoRA may target, and the Experts part each adapts
EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def expert_terms(module: Experts, parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One expert's adapter parts (gate, up and down [A, B scaled], or a fused gate_up's) as
    this rank's terms ExpertLora holds: gate_up (A: gate's rows then up's, B: block-diagonal
    [2 * shard, r], or a fused adapter's A and its two halves of B) and down (A's columns of
    this rank's shard)."""
    lora, size, start, shard = module.lora, module.intermediate_size, module.rank_start, \
        module.shard
    expected = {"gate": (module.hidden_size, size), "up": (module.hidden_size, size),
                "gate_up": (module.hidden_size, 2 * size), "down": (size, module.hidden_size)}
    for part, (a, b) in parts.items():
        buffers = lora.down if part == "down" else lora.gate_up
        if buffers is None:
            raise AdapterError(f"{path}: adapts the experts' {part} projection, outside "
                               "--lora-target-modules")
        if (a.shape[1], b.shape[0]) != expected[part]:
            raise AdapterError(f"{path}: expert {part} has shape {tuple(a.shape)} x "
                               f"{tuple(b.shape)}, not this model's")
    terms = {}
    if "down" in parts:
        a, b = parts["down"]
        terms["down"] = (a[:, start:start + shard], b)
    halves = []  # (A, this rank's gate rows of B, its up rows)
    for part in ("gate", "up", "gate_up"):
        if part in parts:
            a, b = parts[part]
            rows = b[start:start + shard]
            zeros = torch.zeros_like(rows)
            halves.append((a, *{"gate": (rows, zeros), "up": (zeros, rows)}.get(
                part, (rows, b[size + start:size + start + shard]))))
    if halves:
        a = torch.cat([h[0] for h in halves])
        if a.shape[0] > lora.gate_up.a.shape[1]:  # e.g. both a fused gate_up and a gate
            raise AdapterError(f"{path}: an expert's gate and up adapters have rank "
                               f"{a.shape[0]} together, above twice --max-lora-rank")
        terms["gate_up"] = (a, torch.cat([torch.cat([h[1] for h in halves], dim=1),
                                          torch.cat([h[2] for h in halves], dim=1)]))
    return terms


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
    if layout == "per_token" and not (batch.is_decode
                                      or token_slots.numel() <= PER_TOKEN_MAX_TOKENS):
        layout = "masked"
    return slot_layout(token_slots.to(batch.input_positions.device), width, layout, dtype)

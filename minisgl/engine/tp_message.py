"""The step message: what ranks 1..N-1 need to run the forward rank 0 launched, and its wire
format (int arrays for the shared-memory ring)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minisgl.core import Batch, Phase
from minisgl.engine.hicache import KVMoves

PHASES: tuple[Phase, ...] = ("prefill", "decode", "mixed")  # NOTE: wire codes 0..2; -1 is STOP
MSG_MOVES = -2  # meta[0] of a message that only copies pages (Engine.move_pages)


def moves_message(moves: KVMoves) -> list[np.ndarray]:
    return [_ints([MSG_MOVES]), _ints(moves.save_pages), _ints(moves.load_pages)]


@dataclass
class StepMessage:
    """Host tensors and lists. The row lists are padded (CUDA graphs); positions and out_loc
    are not (each rank pads its own device copies). `token_writes` and `location_writes` are
    rank 0's host writes to token_pool / page_table since the previous step, in order; a token
    write (row, start, ids) sets token_pool[row, start:start + len(ids)]."""

    phase: Phase
    size: int
    table_rows: list[int]
    cached_lens: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    positions: torch.Tensor
    out_loc: torch.Tensor
    load_indices: torch.Tensor
    write_indices: torch.Tensor
    logit_rows: torch.Tensor | None
    logits_only: bool = False
    decode_rows: int = 0
    verify_step: bool = False
    row_tokens: int = 0  # Batch.row_tokens
    token_writes: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    location_writes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    lora_slots: list[int] | None = None  # Batch.lora_slots
    lora_loads: list[tuple[int, int, str]] = field(default_factory=list)  # ForwardInput's
    rope_positions: torch.Tensor | None = None  # Batch.rope_positions (not padded)
    state_loads: list[tuple[int, int]] | None = None  # Batch's (hybrid models)
    state_saves: list[tuple[int, int, int]] | None = None
    image_rows: torch.Tensor | None = None  # ForwardInput.image_rows
    image_blocks: list[tuple[int, int, int, int]] | None = None  # Batch's
    kv_saves: list[int] = field(default_factory=list)  # KVMoves' page ids
    kv_loads: list[int] = field(default_factory=list)

    def pack(self) -> list[np.ndarray]:
        tokens, locations = self.token_writes, self.location_writes
        meta = [PHASES.index(self.phase), self.size, int(self.logits_only),
                int(self.logit_rows is not None), self.decode_rows, int(self.verify_step),
                self.row_tokens, -1 if self.rope_positions is None else self.rope_positions.dim(),
                int(self.image_rows is not None)]
        return [
            _ints(meta), _ints(self.table_rows), _ints(self.cached_lens), _ints(self.seq_lens),
            _ints(self.extend_lens), _ints(self.positions), _ints(self.out_loc),
            _ints(self.load_indices), _ints(self.write_indices),
            _ints(self.logit_rows if self.logit_rows is not None else []),
            _ints([row for row, _, _ in tokens]), _ints([start for _, start, _ in tokens]),
            _ints([len(ids) for _, _, ids in tokens]),
            (torch.cat([ids for _, _, ids in tokens]).to(torch.int32).numpy() if tokens
             else np.zeros(0, np.int32)),
            _ints([len(idx) for idx, _ in locations]),
            _ints(torch.cat([idx for idx, _ in locations]) if locations else []),
            _ints(torch.cat([loc for _, loc in locations]) if locations else []),
            _ints([-2] if self.lora_slots is None else self.lora_slots),
            _ints([slot for slot, _, _ in self.lora_loads]),
            _ints([uid for _, uid, _ in self.lora_loads]),
            _ints([len(path.encode()) for _, _, path in self.lora_loads]),
            np.frombuffer(b"".join(path.encode() for _, _, path in self.lora_loads),
                          dtype=np.uint8).astype(np.int64),
            _ints(self.rope_positions.flatten() if self.rope_positions is not None else []),
            _ints([value for load in self.state_loads or () for value in load]),
            _ints([value for save in self.state_saves or () for value in save]),
            _ints(self.image_rows if self.image_rows is not None else []),
            _ints([value for block in self.image_blocks or () for value in block]),
            _ints(self.kv_saves), _ints(self.kv_loads),
        ]

    @classmethod
    def unpack(cls, arrays: list[np.ndarray]) -> StepMessage:
        (meta, rows, cached, seq_lens, extend, positions, out_loc, load, write, logit_rows,
         token_rows, token_starts, token_lens, token_ids, location_lens, location_idx,
         location_vals, lora_slots, load_slots, load_uids, path_lens, path_bytes,
         rope_positions, state_loads, state_saves, image_rows, image_blocks, kv_saves,
         kv_loads) = arrays
        (phase, size, logits_only, has_logit_rows, decode_rows, verify_step,
         row_tokens, rope_dims, has_image_rows) = meta.tolist()
        tokens, at = [], 0
        for row, start, n in zip(token_rows.tolist(), token_starts.tolist(), token_lens.tolist()):
            tokens.append((row, start, torch.from_numpy(token_ids[at:at + n])))
            at += n
        locations, at = [], 0
        for n in location_lens.tolist():
            locations.append((torch.from_numpy(location_idx[at:at + n]),
                              torch.from_numpy(location_vals[at:at + n])))
            at += n
        loads, at = [], 0
        raw = path_bytes.astype(np.uint8).tobytes()
        for slot, uid, n in zip(load_slots.tolist(), load_uids.tolist(), path_lens.tolist()):
            loads.append((slot, uid, raw[at:at + n].decode()))
            at += n
        slots = lora_slots.tolist()
        return cls(PHASES[phase], size, rows.tolist(), cached.tolist(), seq_lens.tolist(),
                   extend.tolist(), torch.from_numpy(positions), torch.from_numpy(out_loc),
                   torch.from_numpy(load), torch.from_numpy(write),
                   torch.from_numpy(logit_rows) if has_logit_rows else None, bool(logits_only),
                   decode_rows, bool(verify_step), row_tokens, tokens, locations,
                   None if slots == [-2] else slots, loads,
                   (torch.from_numpy(rope_positions).view(3, -1) if rope_dims == 2
                    else torch.from_numpy(rope_positions) if rope_dims == 1 else None),
                   _tuples(state_loads, 2), _tuples(state_saves, 3),
                   torch.from_numpy(image_rows) if has_image_rows else None,
                   _tuples(image_blocks, 4), kv_saves.tolist(), kv_loads.tolist())

    def resolve(self, batch: Batch, load_indices: torch.Tensor, write_indices: torch.Tensor,
                logit_rows: torch.Tensor | None,
                draft_writes: list[tuple[int, int, torch.Tensor]]) -> None:
        """Take a verify step's layout, once rank 0 resolved it (engine.speculation), and the
        drafts it wrote into its token pool."""
        self.phase, self.size = batch.phase, batch.size
        self.table_rows, self.cached_lens = batch.table_rows, batch.cached_lens
        self.seq_lens, self.extend_lens = batch.seq_lens, batch.extend_lens
        assert batch.input_positions is not None and batch.out_loc is not None
        self.positions, self.out_loc = batch.input_positions.cpu(), batch.out_loc.cpu()
        self.load_indices, self.write_indices = load_indices.cpu(), write_indices.cpu()
        self.logit_rows = None if logit_rows is None else logit_rows.cpu()
        self.token_writes = self.token_writes + draft_writes
        self.verify_step, self.row_tokens = True, batch.row_tokens

    def kv_moves(self) -> KVMoves | None:
        if not (self.kv_saves or self.kv_loads):
            return None
        return KVMoves(self.kv_saves, self.kv_loads)

    def replay_writes(self, token_pool: torch.Tensor, page_table: torch.Tensor) -> None:
        device = token_pool.device
        for row, start, ids in self.token_writes:
            token_pool[row, start:start + len(ids)] = ids.to(device)
        for flat, locations in self.location_writes:  # NOTE: in order: a later write may overwrite
            page_table.view(-1)[flat.to(device)] = locations.to(device, torch.int32)

    def batch(self, device: torch.device) -> Batch:
        return Batch(self.phase, self.size, self.table_rows, self.cached_lens, self.seq_lens,
                     self.extend_lens, input_positions=self.positions.to(device),
                     out_loc=self.out_loc.to(device), decode_rows=self.decode_rows,
                     lora_slots=self.lora_slots, row_tokens=self.row_tokens,
                     rope_positions=None if self.rope_positions is None
                     else self.rope_positions.to(device), state_loads=self.state_loads,
                     state_saves=self.state_saves, image_blocks=self.image_blocks)


def _ints(values: object) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64).numpy()
    return np.asarray(values, dtype=np.int64)


def _tuples(values: np.ndarray, width: int) -> list | None:
    flat = values.tolist()
    return [tuple(flat[i:i + width]) for i in range(0, len(flat), width)] or None

"""Request slots: a slot is one row of the page table and of the token pool.

The page table maps (slot, position) to a KV location; the token pool holds (slot, position)
token ids, where each batch gathers its input ids and writes its sampled ids. On a GPU both
live on the device, so a host mirror of the page table answers "where is this request's KV"
without a device sync.

With tensor parallelism every other rank keeps its own page table and token pool: with
`mirror=True` each host write is also logged, and the next step carries the log there.
"""

from __future__ import annotations

import torch


class TableManager:
    def __init__(self, max_running: int, dummy_row: int, page_table: torch.Tensor,
                 token_pool: torch.Tensor, mirror: bool = False) -> None:
        self.max_running = max_running
        self.page_table = page_table
        self.token_pool = token_pool
        self.context_len = page_table.shape[1]
        self.dummy_row = dummy_row  # padding rows (CUDA graphs) point here, never at a request
        on_host = page_table.device.type == "cpu"
        self.host_page_table = page_table if on_host else torch.zeros_like(page_table, device="cpu")
        self._free_rows = list(range(max_running - 1, -1, -1))  # pop() hands out row 0 first
        self.token_log: list[tuple[int, int, torch.Tensor]] | None = [] if mirror else None
        self.location_log: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if mirror else None

    def take_log(self) -> tuple[list, list]:
        """(token writes, location writes) since the last call, in order (mirror=True)."""
        assert self.token_log is not None and self.location_log is not None
        tokens, locations = self.token_log, self.location_log
        self.token_log, self.location_log = [], []
        return tokens, locations

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def write_tokens(self, row: int, token_ids: list[int]) -> None:
        ids = torch.tensor(token_ids, dtype=torch.int32)
        self.token_pool[row, : len(token_ids)].copy_(ids, non_blocking=True)
        if self.token_log is not None:
            self.token_log.append((row, 0, ids))

    def write_locations(self, flat_indices: torch.Tensor, locations: torch.Tensor) -> None:
        """page_table[i // context_len, i % context_len] = location, for flat indices i."""
        locations = locations.to(torch.int32)
        if self.location_log is not None:
            self.location_log.append((flat_indices, locations))
        if self.host_page_table is not self.page_table:
            self.host_page_table.view(-1)[flat_indices] = locations
            device = self.page_table.device
            self.page_table.view(-1)[flat_indices.to(device, non_blocking=True)] = locations.to(
                device, non_blocking=True)
        else:
            self.page_table.view(-1)[flat_indices] = locations

    def locations(self, row: int, length: int) -> torch.Tensor:
        return self.host_page_table[row, :length].to(torch.int64)

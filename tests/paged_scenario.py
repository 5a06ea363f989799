"""A small paged-attention scenario shared by the attention-backend tests (CPU and GPU).

Three requests in page_table rows 0..2 whose pages are scattered over the pool in random order:
row 1 first prefills a 32-token prefix alone; then one prefill batch extends row 1 over that
cached prefix and prefills rows 0 and 2 from scratch; then four decode steps of all three.
Every forward runs the model directly (teacher forcing) and returns logits for all its rows.
MIXED_STEPS runs row 1's extension in one mixed forward with a decode of rows 0 and 2 (a mixed
step's spans: the prefill ones, then the trailing decodes of one token each).
"""

from __future__ import annotations

import random

import torch

from minisgl.core import Batch

LENGTHS = {0: 41, 1: 55, 2: 25}  # positions each row reaches by the end
STEPS = [
    ("prefill", [(1, 0, 32)]),
    ("prefill", [(0, 0, 37), (1, 32, 19), (2, 0, 21)]),
    *[("decode", [(0, 37 + i, 1), (1, 51 + i, 1), (2, 21 + i, 1)]) for i in range(4)],
]

MIXED_STEPS = [
    ("prefill", [(1, 0, 32)]),
    ("prefill", [(0, 0, 37), (2, 0, 21)]),
    ("mixed", [(1, 32, 19), (0, 37, 1), (2, 21, 1)]),
    *[("decode", [(0, 38 + i, 1), (1, 51 + i, 1), (2, 22 + i, 1)]) for i in range(3)],
]


def assign_locations(num_pages: int, page_size: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Position j of row r -> page pages_r[j // page_size], offset j % page_size; the pages of
    all rows are distinct and drawn at random from the pool (the dummy page excluded)."""
    rng = random.Random(seed)
    needed = {r: -(-n // page_size) for r, n in LENGTHS.items()}
    pages = rng.sample(range(num_pages), sum(needed.values()))
    out, used = {}, 0
    for row, n in LENGTHS.items():
        own = torch.tensor(pages[used:used + needed[row]], dtype=torch.int64)
        used += needed[row]
        j = torch.arange(n)
        out[row] = own[j // page_size] * page_size + j % page_size
    return out


def token_ids(seed: int = 0, low: int = 100, high: int = 1000) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {r: torch.randint(low, high, (n,), generator=gen) for r, n in LENGTHS.items()}


def fill_page_table(page_table: torch.Tensor, locations: dict[int, torch.Tensor]) -> None:
    for row, locs in locations.items():
        page_table[row, : len(locs)] = locs.to(page_table.device, torch.int32)


def make_batch(phase: str, spans: list[tuple[int, int, int]], locations: dict[int, torch.Tensor],
               device: torch.device) -> tuple[Batch, torch.Tensor]:
    """(batch, input ids) for spans (row, start, count)."""
    positions = torch.cat([torch.arange(s, s + c) for _, s, c in spans])
    decode_rows = 0
    if phase == "mixed":
        while decode_rows < len(spans) - 1 and spans[-1 - decode_rows][2] == 1:
            decode_rows += 1
    out_loc = torch.cat([locations[r][s:s + c] for r, s, c in spans])
    batch = Batch(phase, len(spans), table_rows=[r for r, _, _ in spans],
                  cached_lens=[s for _, s, _ in spans], seq_lens=[s + c for _, s, c in spans],
                  extend_lens=[c for _, _, c in spans],
                  input_positions=positions.to(device, non_blocking=True),
                  out_loc=out_loc.to(device, non_blocking=True), decode_rows=decode_rows)
    return batch, positions


@torch.inference_mode()
def run_scenario(model: torch.nn.Module, backend, page_table: torch.Tensor,
                 locations: dict[int, torch.Tensor], ids: dict[int, torch.Tensor],
                 steps=STEPS) -> list[torch.Tensor]:
    device = page_table.device
    fill_page_table(page_table, locations)
    outputs = []
    for phase, spans in steps:
        batch, _ = make_batch(phase, spans, locations, device)
        inputs = torch.cat([ids[r][s:s + c] for r, s, c in spans]).to(device, torch.int32)
        backend.prepare_metadata(batch)
        logits = model(inputs, batch.input_positions, batch, backend, None)
        outputs.append(logits.float().cpu())
    return outputs


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||, in float32 whatever the inputs' dtypes."""
    ours, ref = ours.detach().float(), ref.detach().float()
    return float((ours - ref).norm() / ref.norm())

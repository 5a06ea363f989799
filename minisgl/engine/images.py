"""Images in a forward: their encoder runs as the step's first phase, once per image, and
their embeddings replace the placeholder tokens' rows of the input embeddings.

Rank 0 encodes; under tensor parallelism it broadcasts the rows' values, which every rank
splices into its own forward (the step message carries the rows)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from minisgl.core import ImageInput
from minisgl.distributed.context import TPInfo, broadcast


# the encoder outputs kept for images read again (the prefix cache seldom ends where an image
# does: a repeated prompt re-reads the image's tail), least recently read first out
ENCODED_BYTES = 256 * 2**20


@dataclass
class ImageSlice:
    """`count` placeholders of `image` from its `first`, at token rows [row, row + count) of
    the batch."""

    image: ImageInput
    first: int
    count: int
    row: int


class EncodedImages:
    """The encoder's outputs by image content key, up to `budget` bytes, least recently read
    evicted first. Engine thread only."""

    def __init__(self, budget: int = ENCODED_BYTES) -> None:
        self.budget, self.used = budget, 0
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()

    def get(self, key: int) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
        return found

    def put(self, key: int, values: torch.Tensor) -> None:
        size = values.numel() * values.element_size()
        if key in self.entries or size > self.budget:
            return
        while self.used + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.used -= old.numel() * old.element_size()
        self.entries[key] = values
        self.used += size


def image_rows(slices: list[ImageSlice]) -> torch.Tensor:
    """The batch's token rows that take image embeddings, in slice order."""
    return torch.cat([torch.arange(s.row, s.row + s.count) for s in slices])


def image_embeddings(model: torch.nn.Module, slices: list[ImageSlice], encoded: EncodedImages
                     ) -> torch.Tensor:
    """[rows, hidden]: the slices' embeddings, in order; the images not in `encoded` are
    encoded together, once each, and kept there."""
    found = {s.image.key: encoded.get(s.image.key) for s in slices}
    pending = list({s.image.key: s.image for s in slices if found[s.image.key] is None}.values())
    if pending:
        outputs = model.encode_images([image.pixels for image in pending],
                                      [image.grid for image in pending])
        for image, values in zip(pending, outputs.split([image.tokens for image in pending])):
            found[image.key] = values
            encoded.put(image.key, values.clone())  # NOTE: a view would keep the whole batch
    return torch.cat([found[s.image.key][s.first:s.first + s.count] for s in slices])


def spliced_embeddings(model: torch.nn.Module, rows: torch.Tensor,
                       slices: list[ImageSlice] | None, encoded: EncodedImages, tp: TPInfo,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) of Batch.input_embeds: rank 0 encodes (`slices`), the others receive."""
    dtype = model.embed_tokens.weight.dtype
    if tp.rank:
        width = getattr(model, "image_width", model.arch.hidden_size)
        values = torch.empty(len(rows), width, dtype=dtype, device=device)
        return rows.to(device), broadcast(values, 0)
    assert slices is not None
    values = image_embeddings(model, slices, encoded).to(device, dtype)
    if tp.size > 1:
        broadcast(values, 0)
    return rows.to(device), values

"""Images in a forward: their encoder runs as the step's first phase, once per image, and
their embeddings replace the placeholder tokens' rows of the input embeddings.

Rank 0 encodes; under tensor parallelism it broadcasts the rows' values, which every rank
splices into its own forward (the step message carries the rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import ImageInput
from minisgl.distributed.context import TPInfo, broadcast


@dataclass
class ImageSlice:
    """`count` placeholders of `image` from its `first`, at token rows [row, row + count) of
    the batch."""

    image: ImageInput
    first: int
    count: int
    row: int

    @property
    def reaches_end(self) -> bool:
        return self.first + self.count == self.image.tokens


def image_rows(slices: list[ImageSlice]) -> torch.Tensor:
    """The batch's token rows that take image embeddings, in slice order."""
    return torch.cat([torch.arange(s.row, s.row + s.count) for s in slices])


def image_embeddings(model: torch.nn.Module, slices: list[ImageSlice]) -> torch.Tensor:
    """[rows, hidden]: the slices' embeddings, in order. Images not encoded yet are encoded
    together; an image whose last placeholder is read here lets its embeddings go."""
    pending = list({id(s.image): s.image for s in slices if s.image.embeddings is None}.values())
    if pending:
        encoded = model.encode_images([image.pixels for image in pending],
                                      [image.grid for image in pending])
        for image, values in zip(pending, encoded.split([image.tokens for image in pending])):
            image.embeddings = values
    values = torch.cat([s.image.embeddings[s.first:s.first + s.count] for s in slices])
    for s in slices:
        if s.reaches_end:
            s.image.embeddings = None
    return values


def spliced_embeddings(model: torch.nn.Module, rows: torch.Tensor,
                       slices: list[ImageSlice] | None, tp: TPInfo, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, values) of Batch.input_embeds: rank 0 encodes (`slices`), the others receive."""
    dtype = model.embed_tokens.weight.dtype
    if tp.rank:
        values = torch.empty(len(rows), model.arch.hidden_size, dtype=dtype, device=device)
        return rows.to(device), broadcast(values, 0)
    assert slices is not None
    values = image_embeddings(model, slices).to(device, dtype)
    if tp.size > 1:
        broadcast(values, 0)
    return rows.to(device), values

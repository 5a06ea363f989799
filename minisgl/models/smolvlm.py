"""SmolVLM (`SmolVLMForConditionalGeneration`; SmolVLM's first release as
`Idefics3ForConditionalGeneration`): a Llama decoder (SmolLM2 in the small ones) whose prompt
may hold images, each seen as square tiles through a SigLIP tower (models.siglip).

The image processor (transformers' SmolVLM one) resizes an image so its longer side is at most
`size.longest_edge`, then to whole multiples of the tile side (`max_image_size`), cuts it into
rows x columns of tiles and adds the whole image shrunk to one tile. Each tile is a unit for
the encoder; the connector folds each 2 x 2 (`scale_factor`) neighbourhood of its patch
embeddings into one vector (pixel shuffle) and projects it to the decoder's width. In the prompt
an image's `<image>` becomes each tile's marker (`<fake_token_around_image><row_r_col_c>`) and
its `<image>` tokens, a newline per row, then the whole image's (`<global-img>`), as the
processor writes it; RoPE is the decoder's plain one."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from minisgl.core import ImageInput, PromptImages
from minisgl.errors import InvalidRequest
from minisgl.layers.base import Layer
from minisgl.layers.linear import DenseLinear
from minisgl.layers.shard import copy_into, read_all
from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import checkpoint_shapes
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.siglip import SiglipShape, SiglipVisionTower
from minisgl.models.weights import text_model_name

VISION_PREFIXES = ("model.vision_model.", "model.connector.")
PLACEHOLDER = "<image>"
TILE_MARK = "<fake_token_around_image>"
WHOLE_MARK = "<global-img>"


class Connector(Layer):  # the checkpoint's `connector.modality_projection.proj`
    def __init__(self, vision_size: int, scale: int, text_size: int) -> None:
        super().__init__()
        self.scale = scale
        self.modality_projection = nn.Module()
        self.modality_projection.proj = DenseLinear(vision_size * scale ** 2, text_size,
                                                    bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tiles, side * side, hidden] -> [tiles, (side / scale)^2, text hidden]: each
        scale x scale block of patches as one vector (its rows of patches side by side)."""
        tiles, patches, hidden = x.shape
        side, s = int(patches ** 0.5), self.scale
        x = x.view(tiles, side, side // s, hidden * s).transpose(1, 2)
        x = x.reshape(tiles, side // s, side // s, hidden * s * s).transpose(1, 2)
        return self.modality_projection.proj(x.reshape(tiles, -1, hidden * s * s))


class SmolVLMForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        vision = arch.config.get("vision_config")
        self.vision_model = self.connector = None
        if vision is not None:
            self.vision_shape = SiglipShape.from_config(vision)
            self.vision_model = SiglipVisionTower(self.vision_shape)
            self.connector = Connector(self.vision_shape.hidden_size,
                                       arch.config.get("scale_factor", 2), arch.hidden_size)
        self.vision_loaded = False

    def load_weight(self, name: str, source: Any) -> bool:
        if not name.startswith(VISION_PREFIXES):
            return super().load_weight(text_model_name(name), source)
        if self.vision_model is not None:
            target = self.get_parameter(name.removeprefix("model."))
            copy_into(target.data, read_all(source), name)
            self.vision_loaded = True
        return True

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """--load-format dummy: the text model's tensors and the vision tower's."""
        shapes = checkpoint_shapes(self.arch)
        for part in ("vision_model", "connector"):
            module = getattr(self, part)
            if module is not None:
                shapes.update({f"model.{part}.{name}": tuple(param.shape)
                               for name, param in module.named_parameters()})
        return shapes

    def encode_images(self, pixels: list[torch.Tensor], grids: list[Any]) -> torch.Tensor:
        """[sum of the tiles' tokens, hidden]: the tiles' embeddings, one after another."""
        assert self.vision_model is not None and self.connector is not None
        weight = self.vision_model.embeddings.patch_embedding.weight
        tiles = torch.cat(pixels).to(weight.device, weight.dtype)
        return self.connector(self.vision_model(tiles)).flatten(0, 1)

    def image_processor(self, folder: Path) -> SmolVLMImages | None:
        if self.vision_model is None or not self.vision_loaded:
            return None
        s = self.vision_shape
        tokens = s.side ** 2 // self.connector.scale ** 2
        return SmolVLMImages(folder, self.arch.config.get("image_token_id"), tokens, s)


class SmolVLMImages:
    """The host side: an image through transformers' SmolVLM image processor into tiles (each
    an ImageInput), and the prompt's `<image>` expanded as the processor writes it."""

    placeholder = PLACEHOLDER

    def __init__(self, folder: Path, token_id: int, tile_tokens: int, shape: SiglipShape
                 ) -> None:
        from transformers import SmolVLMImageProcessorPil
        self.token_id, self.tile_tokens = token_id, tile_tokens
        if (folder / "preprocessor_config.json").exists():
            self.processor = SmolVLMImageProcessorPil.from_pretrained(str(folder))
        else:  # a shape-only folder: tiles of the tower's own size
            side = {"longest_edge": shape.image_size}
            self.processor = SmolVLMImageProcessorPil(
                size={"longest_edge": 4 * shape.image_size}, max_image_size=side)

    def process(self, image: Any) -> list[ImageInput]:
        """The image's tiles (row by row), then the whole image; each unit's grid is
        (rows, columns, its index), rows = columns = 0 for an image left whole."""
        out = self.processor(images=[[image.convert("RGB")]], return_tensors="pt",
                             return_row_col_info=True)
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        tiles = out["pixel_values"][0].float()
        units = []
        for index, tile in enumerate(tiles):
            digest = hashlib.blake2b(tile.numpy().tobytes(), digest_size=16)
            units.append(ImageInput(int.from_bytes(digest.digest(), "little"),
                                    self.tile_tokens, tile[None], (rows, cols, index)))
        return units

    def layout(self, ids: list[int], images: list[list[ImageInput]],
               encode: Callable[[str], list[int]]) -> tuple[list[int], PromptImages]:
        """The prompt with each image's `<image>` expanded to its tiles' markers and tokens,
        and where each tile's tokens sit. The caller checks one placeholder per image."""
        out: list[int] = []
        offsets: list[int] = []
        found = iter(images)
        for token in ids:
            if token != self.token_id:
                out.append(token)
                continue
            units = next(found)
            expanded = self._expansion(units[0].grid[0], units[0].grid[1], encode)
            runs = [i for i, t in enumerate(expanded)
                    if t == self.token_id and (i == 0 or expanded[i - 1] != self.token_id)]
            if len(runs) != len(units):
                raise InvalidRequest(f"the image's prompt holds {len(runs)} tiles for its "
                                 f"{len(units)}")
            offsets += [len(out) + run for run in runs]
            out += expanded
        return out, PromptImages([unit for units in images for unit in units], offsets)

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one per served model)
    def _expansion(self, rows: int, cols: int, encode: Callable[[str], list[int]]
                   ) -> list[int]:
        tokens = PLACEHOLDER * self.tile_tokens
        whole = TILE_MARK + WHOLE_MARK + tokens + TILE_MARK
        if rows == 0 and cols == 0:
            return encode(whole)
        text = "".join("".join(f"{TILE_MARK}<row_{r + 1}_col_{c + 1}>{tokens}"
                               for c in range(cols)) + "\n" for r in range(rows))
        return encode(text + "\n" + whole)

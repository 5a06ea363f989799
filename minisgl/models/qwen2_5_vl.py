"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 decoder whose prompt may hold
images. models.weights reads its `text_config` (or the older flat config) and keeps its
`vision_config`; the encoder is models.qwen2_5_vision.

An image is one `<|image_pad|>` token in the prompt, expanded to one placeholder per 2 x 2
patches; the encoder's output replaces their embeddings. Multimodal RoPE turns a text token
alike in its three sections (the plain RoPE, for text alone) and an image's placeholders by
(the image's start, their row, their column); tokens after an image continue from its
largest position, so a token's position is its index plus the prompt's `rope_delta`."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch

from minisgl.core import ImageInput, PromptImages
from minisgl.layers.shard import copy_into, read_all
from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import checkpoint_shapes
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.qwen2_5_vision import Grid, Qwen2_5VisionEncoder, VisionShape
from minisgl.models.weights import text_model_name

VISION_PREFIXES = ("visual.", "model.visual.")
IMAGE_TOKEN_ID = 151655  # <|image_pad|>, where a config leaves it out
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # one image in a chat prompt


class QwenVision:
    """What a decoder with Qwen's vision tower shares (Qwen2.5-VL's, Qwen3.5's): the tower as
    `visual` (the checkpoint's `visual.*` or `model.visual.*`), loaded, listed for dummy
    weights, run on a step's images, and its image processor."""

    arch: ModelArch
    visual: Any  # the encoder; None for a checkpoint without a vision_config
    vision_loaded = False  # a GGUF file, for one, holds no vision tensors

    def load_vision(self, name: str, source: Any) -> bool:
        """Load a vision tensor; False for a name outside the tower."""
        if not name.startswith(VISION_PREFIXES):
            return False
        if self.visual is not None:
            local = name.removeprefix("model.").removeprefix("visual.")
            copy_into(self.visual.get_parameter(local).data, read_all(source), name)
            self.vision_loaded = True
        return True

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """--load-format dummy: the decoder's tensors and the vision tower's."""
        shapes = checkpoint_shapes(self.arch)
        if self.visual is not None:
            shapes.update({f"visual.{name}": tuple(param.shape)
                           for name, param in self.visual.named_parameters()})
        return shapes

    def encode_images(self, pixels: list[torch.Tensor], grids: list[Grid]) -> torch.Tensor:
        """[sum of the images' tokens, hidden]: the images' embeddings, one after another."""
        assert self.visual is not None
        weight = self.visual.patch_embed.proj.weight
        return self.visual(torch.cat(pixels).to(weight.device, weight.dtype), grids)

    def image_processor(self, folder: Path) -> Qwen2_5VLImages | None:
        """What turns a request's images into its prompt's (None: no vision tower loaded)."""
        if self.visual is None or not self.vision_loaded:
            return None
        return Qwen2_5VLImages(folder, self.visual.shape,
                               self.arch.config.get("image_token_id") or IMAGE_TOKEN_ID)


class Qwen2_5_VLForCausalLM(QwenVision, LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        vision = arch.config.get("vision_config")
        self.visual = (Qwen2_5VisionEncoder(VisionShape.from_config(vision))
                       if vision is not None else None)

    def load_weight(self, name: str, source: Any) -> bool:
        return self.load_vision(name, source) or super().load_weight(text_model_name(name),
                                                                       source)


class Qwen2_5VLImages:
    """The host side: an image through transformers' Qwen2-VL image processor (resized to a
    multiple of 28 pixels within the checkpoint's pixel bounds, normalised, cut in patches),
    and a prompt's placeholders expanded and laid out for multimodal RoPE."""

    placeholder = PLACEHOLDER

    def __init__(self, folder: Path, shape: VisionShape, token_id: int) -> None:
        from transformers import Qwen2VLImageProcessorPil
        self.shape, self.token_id = shape, token_id
        own = {"patch_size": shape.patch_size, "merge_size": shape.merge,
               "temporal_patch_size": shape.temporal_patch_size}
        if (folder / "preprocessor_config.json").exists():
            self.processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder), **own)
        else:
            self.processor = Qwen2VLImageProcessorPil(**own)

    def process(self, image: Any) -> list[ImageInput]:
        """A PIL image, processed: one unit (its patches, grid, token count, content key)."""
        out = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        pixels = out["pixel_values"].float()
        grid: Grid = tuple(out["image_grid_thw"][0].tolist())  # type: ignore[assignment]
        digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16,
                                 key=repr(grid).encode())
        tokens = grid[0] * grid[1] * grid[2] // self.shape.merge ** 2
        return [ImageInput(int.from_bytes(digest.digest(), "little"), tokens, pixels, grid)]

    def layout(self, ids: list[int], images: list[list[ImageInput]],
               encode: Callable[[str], list[int]]) -> tuple[list[int], PromptImages]:
        """The prompt with each image's placeholder token expanded to its tokens, and where
        they sit. The caller checks that the prompt holds one placeholder per image."""
        units = [unit for image in images for unit in image]  # one each
        out: list[int] = []
        offsets = []
        found = iter(units)
        for token in ids:
            if token == self.token_id:
                offsets.append(len(out))
                out += [token] * next(found).tokens
            else:
                out.append(token)
        rope = self.rope_positions(len(out), units, offsets)
        return out, PromptImages(units, offsets, rope, int(rope.max()) + 1 - len(out))

    def rope_positions(self, length: int, images: list[ImageInput], offsets: list[int]
                       ) -> torch.Tensor:
        """[3, length]: text tokens count on from the last position; an image's placeholders
        sit at (start, start + row, start + column), and the text after it goes on from
        start + its larger side."""
        merge = self.shape.merge
        parts, position, index = [], 0, 0
        for image, offset in zip(images, offsets):
            text = offset - index
            parts.append(torch.arange(position, position + text).expand(3, text))
            position += text
            t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            frame = torch.stack([torch.zeros(h * w, dtype=torch.int64), rows.flatten(),
                                 cols.flatten()])
            frames = torch.cat([frame + torch.tensor([[f], [0], [0]]) for f in range(t)], 1)
            parts.append(frames + position)
            position += max(h, w)
            index = offset + image.tokens
        parts.append(torch.arange(position, position + length - index).expand(3, -1))
        return torch.cat(parts, dim=1)

"""Gemma 3's images: a SigLIP tower (models.siglip) on the image resized to its square size,
its patch embeddings averaged in blocks down to `mm_tokens_per_image` (256: 16 x 16), normed
(Gemma's RMSNorm, 1 + w) and projected to the decoder's width.

In the prompt an image is `<start_of_image>`, which its processor writes out as a blank line,
`<start_of_image>`, the image's `<image_soft_token>`s, `<end_of_image>` and a blank line; the
decoder's attention lets an image's tokens see each other both ways (Batch.image_blocks). A text
prompt is written out as text before it is tokenized, as transformers' processor does; a prompt
of ids gets the written-out text's ids in place of each `<start_of_image>` id."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import ImageInput, PromptImages
from minisgl.errors import InvalidRequest
from minisgl.layers.base import Layer
from minisgl.models.siglip import SiglipShape, SiglipVisionTower

BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


class Gemma3Projector(Layer):
    """The checkpoint's `multi_modal_projector`."""

    def __init__(self, shape: SiglipShape, tokens: int, text_size: int) -> None:
        super().__init__()
        self.eps = shape.eps
        self.tokens_side = int(tokens ** 0.5)
        self.kernel = shape.side // self.tokens_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(shape.hidden_size, text_size),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(shape.hidden_size),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, side * side, hidden] -> [images, tokens, text hidden]."""
        images, patches, hidden = x.shape
        side = int(patches ** 0.5)
        grid = x.transpose(1, 2).reshape(images, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)
        normed = pooled.float() * torch.rsqrt(pooled.float().pow(2).mean(-1, keepdim=True)
                                              + self.eps)
        normed = normed * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(normed.to(x.dtype), self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    """The tower and projector under the checkpoint's names (`vision_tower.vision_model.*`,
    `multi_modal_projector.*`), held by the decoder (models.gemma)."""

    def __init__(self, config: dict[str, Any], text_size: int) -> None:
        super().__init__()
        self.shape = SiglipShape.from_config(config["vision_config"])
        self.tokens = config.get("mm_tokens_per_image", 256)
        self.vision_tower = nn.Module()
        self.vision_tower.vision_model = SiglipVisionTower(self.shape)
        self.multi_modal_projector = Gemma3Projector(self.shape, self.tokens, text_size)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower.vision_model(pixels))


class Gemma3Images:
    """The host side: transformers' Gemma 3 image processor (the image resized to the tower's
    square), and the prompt's `<start_of_image>` written out."""

    placeholder = BOI

    def __init__(self, folder: Path, vision: Gemma3Vision, config: dict[str, Any]) -> None:
        from transformers import Gemma3ImageProcessorPil
        self.token_id = config.get("boi_token_index", 255999)
        self.soft_id = config.get("image_token_index", 262144)
        self.eoi_id = config.get("eoi_token_index", 256000)
        self.tokens = vision.tokens
        self.written = f"\n\n{BOI}{SOFT * self.tokens}{EOI}\n\n"
        if (folder / "preprocessor_config.json").exists():
            self.processor = Gemma3ImageProcessorPil.from_pretrained(str(folder))
        else:
            side = vision.shape.image_size
            self.processor = Gemma3ImageProcessorPil(size={"height": side, "width": side})

    def expand_text(self, text: str) -> str:
        return text.replace(BOI, self.written)

    def process(self, image: Any) -> list[ImageInput]:
        out = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        pixels = out["pixel_values"].float()  # [1, channels, side, side]
        digest = hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16)
        return [ImageInput(int.from_bytes(digest.digest(), "little"), self.tokens, pixels,
                           (1, pixels.shape[-2], pixels.shape[-1]))]

    def layout(self, ids: list[int], images: list[list[ImageInput]],
               encode: Callable[[str], list[int]]) -> tuple[list[int], PromptImages]:
        """Each `<start_of_image>` written out (a text prompt's already is), and where each
        image's soft tokens sit."""
        out: list[int] = []
        offsets: list[int] = []
        whole = [self.soft_id] * self.tokens + [self.eoi_id]
        for i, token in enumerate(ids):
            if token == self.token_id and ids[i + 1:i + 2] == [self.soft_id]:
                if ids[i + 1:i + 2 + self.tokens] != whole:
                    raise InvalidRequest(f"a <start_of_image> followed by image tokens must be "
                                         f"followed by {self.tokens} of them and "
                                         "<end_of_image>")
                offsets.append(len(out) + 1)  # written out already (a text prompt's is)
            elif token == self.token_id:
                written = encode(self.written)
                offsets.append(len(out) + written.index(self.soft_id))
                out += written
                continue
            out.append(token)
        units = [unit for image in images for unit in image]
        return out, PromptImages(units, offsets, whole=True)

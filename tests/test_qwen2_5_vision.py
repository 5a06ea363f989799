"""Qwen2.5-VL's vision encoder (models.qwen2_5_vision) against transformers' in float32, on a
tiny random Qwen2_5_VLForConditionalGeneration built here (nothing downloaded): images of
different sizes through transformers' own image processor, alone and in one call, windows
that tile an image unevenly, full-attention blocks among windowed ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.models.qwen2_5_vision import Qwen2_5VisionEncoder, VisionShape

# |ours - transformers| over the embeddings (values up to ~0.25); the patch embedding is a
# matmul here, a Conv3d there (another summation order): measured <= 2e-7. Every block
# windowed (a full-attention block missed) gives 4e-3.
TOLERANCE = 1e-5
VISION = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
              fullatt_block_indexes=[1, 3])
TEXT = dict(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, Qwen2_5VisionEncoder]:
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    reference = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    visual = reference.model.visual
    with torch.no_grad():  # norms start at one: give them values
        for name, param in visual.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.2)
    ours = Qwen2_5VisionEncoder(VisionShape.from_config(config.vision_config.to_dict()))
    ours.load_state_dict(visual.state_dict())
    return visual, ours


def processed(sizes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random RGB images of (width, height) through transformers' Qwen2-VL image processor."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in sizes]
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 400)
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.parametrize("sizes", [
    [(224, 224)],  # windows tile the image evenly
    [(300, 190)],  # the last window row and column cut short
    [(300, 190), (120, 400), (64, 64)],  # three images in one call
])
def test_encoder_matches_transformers(models, sizes) -> None:
    visual, ours = models
    pixels, grids = processed(sizes)
    with torch.inference_mode():
        want = visual(pixels, grid_thw=grids).pooler_output
        got = ours(pixels, [tuple(g) for g in grids.tolist()])
    assert got.shape == want.shape == (sum(ours.output_tokens(tuple(g))
                                           for g in grids.tolist()), VISION["out_hidden_size"])
    assert (got - want).abs().max().item() < TOLERANCE


def test_images_in_one_call_equal_each_alone(models) -> None:
    _, ours = models
    pixels, grids = processed([(300, 190), (120, 400)])
    grid_list = [tuple(g) for g in grids.tolist()]
    first = grid_list[0][0] * grid_list[0][1] * grid_list[0][2]
    with torch.inference_mode():
        both = ours(pixels, grid_list)
        alone = torch.cat([ours(pixels[:first], grid_list[:1]),
                           ours(pixels[first:], grid_list[1:])])
    assert (both - alone).abs().max().item() < 1e-5


def test_pixels_that_do_not_match_the_grids_are_refused(models) -> None:
    _, ours = models
    pixels, grids = processed([(224, 224)])
    with pytest.raises(ValueError, match="do not match the grids"):
        ours(pixels[:-4], [tuple(g) for g in grids.tolist()])

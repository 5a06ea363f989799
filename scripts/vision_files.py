"""A random vision-language model of a real vision shape, for minisgl and llama.cpp side by side
(nothing downloaded), SmolLM2's vocabulary with the family's image tokens added:

- `qwen2.5-vl`: Qwen2.5-VL-3B's vision tower (32 blocks of 1280, windows of 112 pixels, four
  full-attention blocks) and its text model cut to `--layers` layers (hidden 2048, 16 query
  and 2 KV heads, MLP 11008), Qwen2.5-VL's image processor settings;
- `qwen3-vl`: Qwen3-VL-2B's vision tower (24 blocks of 1024 on 16-pixel patches, a 48 x 48
  position table, deepstack from blocks 5, 11 and 17) and its Qwen3 decoder cut to `--layers`
  layers (hidden 2048, 16 query and 8 KV heads of 128, MLP 6144);
- `gemma3`: Gemma 3 4B's SigLIP tower (27 layers of 1152 on 896-pixel images, 256 tokens an
  image) and its decoder cut to `--layers` layers (hidden 2560, 8 query and 4 KV heads of 256,
  MLP 10240, five windowed layers to a global one);
- `smolvlm`: SmolVLM-256M: a SigLIP tower of 12 layers of 768 on 512-pixel tiles of 16-pixel
  patches, folded 4 x 4 into 64 tokens a tile, and SmolLM2-135M's decoder (30 layers; cut by
  `--layers`), images up to 2048 pixels a side in tiles.

Written three ways into `--out`:

- `hf/`: the transformers checkpoint (bfloat16) minisgl serves;
- `text-bf16.gguf` and `mmproj-bf16.gguf`: the same weights through llama.cpp's converter
  (`--mmproj` for the vision tower), as its `llama-server --mmproj` serves them.

    python scripts/vision_files.py qwen2.5-vl --out /tmp/qwen-vl --python PYTHON
    python scripts/vision_files.py smolvlm --out /tmp/smolvlm --layers 30 --python PYTHON

llama.cpp's converter imports `sentencepiece` for Qwen's vocabulary before it falls back to a
BPE one: `--python` names an interpreter that has it besides torch and transformers (the
test environment does not install it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp_files import LLAMA_CPP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl.models.weights import bundled_gguf  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
              out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
              window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)
PIXELS = dict(min_pixels=3136, max_pixels=12845056)  # Qwen2.5-VL's preprocessor_config.json


def bundled_tokenizer(extra: list[str]) -> transformers.PreTrainedTokenizerBase:
    gguf = bundled_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_special_tokens({"additional_special_tokens": extra})
    return tokenizer


def randomize_norms(model: torch.nn.Module) -> None:
    with torch.no_grad():  # the norms start at one; weights at transformers' 0.02 std
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)


def save_random(hf: Path, model_class: Any, config: Any, tokenizer: Any, processor: Any
                ) -> torch.nn.Module:
    """The model of `config` with random weights (fixed seed, bfloat16, norms randomized) saved
    to `hf` with its tokenizer and image processor; returned for what a family adds after."""
    torch.manual_seed(0)
    model = model_class(config).to(torch.bfloat16)
    randomize_norms(model)
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    processor.save_pretrained(hf)
    return model


def smolvlm(hf: Path, layers: int) -> None:
    marks = ["<image>", "<fake_token_around_image>", "<global-img>",
             *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
    tokenizer = bundled_tokenizer(marks)
    text = dict(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                architectures=["LlamaForCausalLM"], model_type="llama")
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=512, patch_size=16)
    config = transformers.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=4,
                                        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                        tie_word_embeddings=True)
    save_random(hf, transformers.SmolVLMForConditionalGeneration, config, tokenizer,
                transformers.SmolVLMImageProcessorPil(size={"longest_edge": 2048},
                                                      max_image_size={"longest_edge": 512}))


def gemma3(hf: Path, layers: int) -> None:
    marks = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    tokenizer = bundled_tokenizer(marks)
    boi, soft, eoi = tokenizer.convert_tokens_to_ids(marks)
    text = dict(vocab_size=len(tokenizer), hidden_size=2560, intermediate_size=10240,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                    "rope_theta": 1_000_000.0},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10_000.0}},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                  num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       boi_token_index=boi, eoi_token_index=eoi,
                                       image_token_index=soft, mm_tokens_per_image=256)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.bfloat16)
    randomize_norms(model)
    with torch.no_grad():  # the projector starts at zero
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.02)
    model.save_pretrained(hf)
    hub_vision_names(hf)
    tokenizer.save_pretrained(hf)
    transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}).save_pretrained(hf)


def hub_vision_names(hf: Path) -> None:
    """The vision tensors under the Hub's names (`vision_tower.vision_model.*`), which
    llama.cpp's converter maps; transformers 5 writes them without `vision_model.`."""
    from safetensors.torch import load_file, save_file
    for file in hf.glob("*.safetensors"):
        tensors = load_file(file)
        renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower.")
                    if name.startswith("vision_tower.") else name): tensor
                   for name, tensor in tensors.items()}
        save_file(renamed, file, metadata={"format": "pt"})


def qwen3_vl(hf: Path, layers: int) -> None:
    tokenizer = bundled_tokenizer(VISION_TOKENS)
    start, pad, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=6144,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                 "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    vision = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                  out_hidden_size=2048, patch_size=16, num_position_embeddings=2304,
                  deepstack_visual_indexes=[5, 11, 17])
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision,
                                        image_token_id=pad, vision_start_token_id=start,
                                        vision_end_token_id=end, tie_word_embeddings=True)
    save_random(hf, transformers.Qwen3VLForConditionalGeneration, config, tokenizer,
                transformers.Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3,
                                                      image_std=[0.5] * 3, **PIXELS))


def qwen2_5_vl(hf: Path, layers: int) -> None:
    tokenizer = bundled_tokenizer(VISION_TOKENS)
    start, pad, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=11008,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2,
                max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                 "rope_theta": 1_000_000.0})
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=VISION,
                                           image_token_id=pad, vision_start_token_id=start,
                                           vision_end_token_id=end, tie_word_embeddings=True)
    save_random(hf, transformers.Qwen2_5_VLForConditionalGeneration, config, tokenizer,
                transformers.Qwen2VLImageProcessorPil(**PIXELS))


def convert(hf: Path, out: Path, python: str) -> None:
    src = LLAMA_CPP / "src"
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    for name, flags in (("text-bf16.gguf", ()), ("mmproj-bf16.gguf", ("--mmproj",))):
        subprocess.run([python, str(src / "convert_hf_to_gguf.py"), str(hf),
                        "--outfile", str(out / name), "--outtype", "bf16", *flags], check=True,
                       env=env)


FAMILIES = {"qwen2.5-vl": qwen2_5_vl, "qwen3-vl": qwen3_vl, "smolvlm": smolvlm,
            "gemma3": gemma3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8,
                        help="text layers (Qwen2.5-VL-3B has 36, SmolVLM-256M 30)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that runs llama.cpp's converter")
    args = parser.parse_args()
    hf = args.out / "hf"
    if not (hf / "config.json").exists():
        FAMILIES[args.family](hf, args.layers)
    convert(hf, args.out, args.python)


if __name__ == "__main__":
    main()

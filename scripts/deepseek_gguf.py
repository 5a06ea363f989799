"""A random DeepSeek GGUF file for minisgl and llama.cpp side by side (nothing downloaded):
DeepSeek-V2-Lite's widths (the shipped `minisgl/models/configs/deepseek-v2-lite`: 16 heads,
kv_lora_rank 512, 64 experts of 1408, top 6, two shared) cut to `--layers` (the first dense),
with V2's and V3's low-rank query (q_lora_rank 1536: llama.cpp takes a file without one only
at V2-Lite's 27 layers), the bundled SmolLM2 vocabulary (llama-server needs a tokenizer),
random bfloat16 weights; written by llama.cpp's own converter and quantized by its
`llama-quantize` (both from the tree `make bench` builds into ~/.cache/minisgl/llama.cpp).

    python scripts/deepseek_gguf.py --layers 4 --type Q4_K_M --out /tmp/deepseek-4l.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp_files import ROOT, write_with_llama_cpp  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shape = json.loads((ROOT / "minisgl/models/configs/deepseek-v2-lite/config.json").read_text())
    rope = shape.pop("rope_scaling")
    rope.update(rope_type=rope.pop("type"), rope_theta=shape.pop("rope_theta"))
    for key in ("architectures", "model_type"):
        shape.pop(key)
    shape.update(num_hidden_layers=args.layers, vocab_size=49152, bos_token_id=1,
                 eos_token_id=2, q_lora_rank=1536, rope_parameters=rope)
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**shape))
    write_with_llama_cpp(model, args.out, args.type,
                         # as the Hub's config says; the converter reads it
                         edit_config=lambda config: config.update(scoring_func="softmax"))


if __name__ == "__main__":
    main()

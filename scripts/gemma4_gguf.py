"""A random Gemma 4 GGUF file for minisgl and llama.cpp side by side (nothing downloaded):
Gemma 4 E2B's text model (the shipped `minisgl/models/configs/gemma-4-e2b`: 8 heads, one KV
head, 256-dim sliding and 512-dim global heads, per-layer inputs, the double-wide MLP of the
KV-sharing layers) cut to `--layers`, the last `--shared` of them sharing KV, the bundled
SmolLM2 vocabulary (llama-server needs a tokenizer), transformers' random initialisation,
written as llama.cpp's converter writes it (tests/gguf_families.write_gemma4_gguf, checked
against the converter) with Q8_0 linears.

    python scripts/gemma4_gguf.py --layers 10 --shared 5 --out /tmp/gemma4-e2b-10l.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from gguf import GGMLQuantizationType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gguf_families import write_gemma4_gguf  # noqa: E402

VOCAB = 49152  # the bundled tokenizer's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--shared", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    config = json.loads((ROOT / "minisgl/models/configs/gemma-4-e2b/config.json").read_text())
    text = config["text_config"]
    for key in ("model_type", "use_bidirectional_attention"):
        text.pop(key)
    text.update(num_hidden_layers=args.layers, num_kv_shared_layers=args.shared,
                layer_types=text["layer_types"][:args.layers], vocab_size=VOCAB,
                vocab_size_per_layer_input=VOCAB, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        write_gemma4_gguf(Path(folder), args.out, GGMLQuantizationType.Q8_0)


if __name__ == "__main__":
    main()

"""A GGUF file of a larger Llama shape with random weights, for timing only (its outputs mean
nothing): the bundled file's tokenizer, RoPE base and tensor types (Q4_1 linears, a Q8_0
token table tied to the output head, float32 norms), every size set to the shape's. minisgl
and llama.cpp's llama-server read the same file, so both read the same bytes per token.

    python scripts/llama_gguf.py [--shape llama-1b] [--out PATH]   # prints the path
    python -m minisgl.bench ab --gguf "$(python scripts/llama_gguf.py)" \\
        --variant minisgl='--quantization gguf' --variant llama.cpp=@llama-server
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType  # noqa: E402

from minisgl.env import cache_root  # noqa: E402
from tests.gguf_families import copy_tokenizer, decoder_writer, finish  # noqa: E402

Kind = GGMLQuantizationType
# hidden, feed-forward, layers, query heads, KV heads (head dim 64, as the bundled model's)
SHAPES = {"llama-1b": (2048, 8192, 16, 32, 8)}
VOCAB = 49152  # the bundled tokenizer's
BLOCK = 32
BLOCK_BYTES = {Kind.Q4_1: 20, Kind.Q8_0: 34}


def random_blocks(rows: int, columns: int, kind: Kind, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of `kind` for a [rows, columns] weight: random codes, scale 0.01 (Q4_1's
    minimum -0.08, so weights centre on 0)."""
    blocks = rng.integers(0, 256, (rows, columns // BLOCK, BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks[..., 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if kind == Kind.Q4_1:
        blocks[..., 2:4] = np.array([-0.08], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write(shape: str, out: Path) -> Path:
    hidden, ffn, layers, heads, kv_heads = SHAPES[shape]
    kv = kv_heads * (hidden // heads)
    partial = out.with_suffix(f".{os.getpid()}.partial")
    writer = decoder_writer(partial, "llama", SimpleNamespace(
        num_hidden_layers=layers, max_position_embeddings=8192, hidden_size=hidden,
        intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv_heads))
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(hidden // heads)
    copy_tokenizer(writer)
    rng = np.random.default_rng(0)
    tensors = [("token_embd.weight", VOCAB, hidden, Kind.Q8_0),
               ("output_norm.weight", 1, hidden, Kind.F32)]
    for i in range(layers):
        tensors += [(f"blk.{i}.{name}.weight", rows, columns, kind) for name, rows, columns, kind
                    in [("attn_norm", 1, hidden, Kind.F32), ("attn_q", hidden, hidden, Kind.Q4_1),
                        ("attn_k", kv, hidden, Kind.Q4_1), ("attn_v", kv, hidden, Kind.Q4_1),
                        ("attn_output", hidden, hidden, Kind.Q4_1),
                        ("ffn_norm", 1, hidden, Kind.F32), ("ffn_gate", ffn, hidden, Kind.Q4_1),
                        ("ffn_up", ffn, hidden, Kind.Q4_1), ("ffn_down", hidden, ffn, Kind.Q4_1)]]
    for name, rows, columns, kind in tensors:
        data = (np.ones(columns, dtype=np.float32) if kind == Kind.F32
                else random_blocks(rows, columns, kind, rng))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    finish(writer)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: the cache's bench-models folder (written once)")
    args = parser.parse_args()
    out = args.out or cache_root() / "bench-models" / f"{args.shape}-random.Q4_1.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write(args.shape, out)
    print(out)


if __name__ == "__main__":
    main()

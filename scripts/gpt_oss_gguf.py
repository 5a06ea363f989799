"""A random gpt-oss GGUF file of a real shape, for minisgl and llama.cpp side by side (nothing
downloaded): the shipped shape-only config (`minisgl/models/configs/gpt-oss-20b`) cut to
`--layers`, the bundled SmolLM2 vocabulary (llama-server needs a tokenizer; 49152 rows in
place of 201k), experts MXFP4 (random codes, every block's scale 2^-7, as
`--load-format dummy --quantization mxfp4`) or `--experts` another type, the other matrices
F16, norms and biases F32.

    python scripts/gpt_oss_gguf.py --layers 2 --out /tmp/gpt-oss-20b-2l.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGMLQuantizationType  # noqa: E402
from transformers import GptOssConfig  # noqa: E402

from minisgl.models.dummy_weights import MXFP4_EXPONENT  # noqa: E402
from tests.gguf_families import finish, gpt_oss_writer  # noqa: E402
from tests.gguf_requant import encode  # noqa: E402

VOCAB = 49152  # the bundled tokenizer's


def mxfp4(rng: np.random.Generator, experts: int, out: int, in_features: int) -> np.ndarray:
    """Random MXFP4 blocks [experts, out, in / 32 * 17]: an e8m0 byte, 16 bytes of codes."""
    blocks = rng.integers(0, 256, size=(experts, out, in_features // 32, 17), dtype=np.uint8)
    blocks[..., 0] = MXFP4_EXPONENT
    return blocks.reshape(experts, out, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", default="MXFP4", help="MXFP4, or a type gguf writes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = GptOssConfig.from_pretrained(ROOT / "minisgl/models/configs/gpt-oss-20b")
    config.num_hidden_layers, config.vocab_size = args.layers, VOCAB
    hidden, inter, experts = config.hidden_size, config.intermediate_size, \
        config.num_local_experts
    q, kv = config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    rng = np.random.default_rng(args.seed)
    writer = gpt_oss_writer(args.out, config)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def small(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    kind = GGMLQuantizationType[args.experts]
    writer.add_tensor("token_embd.weight", dense(VOCAB, hidden))
    writer.add_tensor("output.weight", dense(VOCAB, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(args.layers):
        p = f"blk.{layer}."
        for name in ("attn_norm", "post_attention_norm"):
            writer.add_tensor(p + name + ".weight", np.ones(hidden, dtype=np.float32))
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            writer.add_tensor(p + name + ".weight", dense(rows, hidden))
            writer.add_tensor(p + name + ".bias", small(rows))
        writer.add_tensor(p + "attn_output.weight", dense(hidden, q))
        writer.add_tensor(p + "attn_output.bias", small(hidden))
        writer.add_tensor(p + "attn_sinks.weight", small(config.num_attention_heads))
        writer.add_tensor(p + "ffn_gate_inp.weight", small(experts, hidden))
        writer.add_tensor(p + "ffn_gate_inp.bias", small(experts))
        for part, out, in_features in (("gate", inter, hidden), ("up", inter, hidden),
                                       ("down", hidden, inter)):
            if kind == GGMLQuantizationType.MXFP4:
                data = mxfp4(rng, experts, out, in_features)
            else:
                data = encode(small(experts, out, in_features), kind)
            writer.add_tensor(p + f"ffn_{part}_exps.weight", data, raw_shape=data.shape,
                              raw_dtype=kind)
            writer.add_tensor(p + f"ffn_{part}_exps.bias", small(experts, out))
    finish(writer)
    print(args.out)


if __name__ == "__main__":
    main()

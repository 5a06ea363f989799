"""A random hybrid GGUF file for minisgl and llama.cpp side by side (nothing downloaded): the
small shapes BENCHMARKS.md's hybrid tables measure, random weights, SmolLM2's vocabulary,
written by llama.cpp's converter (Qwen3.5's converter does not know SmolLM2's pre-tokenizer:
those by tests/gguf_families.py's writer, in F32, which writes the converter's tensors) and
quantized by its `llama-quantize`.

- `granite`: Granite 4.0-H, 350M-class (32 layers, 28 Mamba2 and 4 attention without RoPE,
  hidden 768, 48 Mamba2 heads of 32 in one group, a shared MLP of 2048);
- `qwen3.5`: dense Qwen3.5, 0.5B-class (24 layers, three Gated DeltaNet to one gated attention,
  hidden 1024, 16 key and 16 value heads of 128, MLP 3584);
- `qwen3.5-moe`: Qwen3.5-35B-A3B's kind cut to ~1B (16 layers, three Gated DeltaNet to one
  gated attention, hidden 1024, 16 key and 16 value heads of 128; 64 experts of 256, top 8, a
  gated shared expert of 256);
- `nemotron-h`: Nemotron 3 Nano-like, 0.4B (16 layers `MEMEM*EMEMEM*EME`: 7 Mamba2, 7 of
  experts, 2 attention; hidden 1024, 32 Mamba2 heads of 64 in 8 groups, 32 relu² experts of
  512, top 6, a shared expert of 1024, 16 query and 2 KV heads of 64).

    python scripts/hybrid_gguf.py nemotron-h --type Q4_K_M --out /tmp/n-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp_files import quantize, write_with_llama_cpp  # noqa: E402

VOCAB = dict(vocab_size=49152, pad_token_id=0, bos_token_id=1, eos_token_id=2)
NEMOTRON_LAYERS = {"M": "mamba", "E": "moe", "*": "attention"}


def granite() -> torch.nn.Module:
    config = transformers.GraniteMoeHybridConfig(
        **VOCAB, hidden_size=768, num_hidden_layers=32,
        layer_types=["attention" if i % 8 == 7 else "mamba" for i in range(32)],
        num_attention_heads=12, num_key_value_heads=4, shared_intermediate_size=2048,
        num_local_experts=0, mamba_n_heads=48, mamba_d_head=32, mamba_n_groups=1,
        mamba_d_state=128, mamba_expand=2, position_embedding_type="nope",
        tie_word_embeddings=True)
    return transformers.GraniteMoeHybridForCausalLM(config)


def qwen3_5_shape(layers: int) -> dict:
    """What the dense and the MoE Qwen3.5 shapes share: hidden 1024, three Gated DeltaNet
    layers to one gated attention."""
    return dict(**VOCAB, hidden_size=1024, num_hidden_layers=layers,
                layer_types=["full_attention" if i % 4 == 3 else "linear_attention"
                             for i in range(layers)],
                num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, tie_word_embeddings=True)


def qwen3_5() -> torch.nn.Module:
    config = transformers.Qwen3_5TextConfig(**qwen3_5_shape(24), intermediate_size=3584)
    return transformers.Qwen3_5ForCausalLM(config)


def qwen3_5_moe() -> torch.nn.Module:
    config = transformers.Qwen3_5MoeTextConfig(
        **qwen3_5_shape(16), num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        intermediate_size=256)  # NOTE: not the model's; the writer puts it in the file
    return transformers.Qwen3_5MoeForCausalLM(config)


def nemotron_h() -> torch.nn.Module:
    config = transformers.NemotronHConfig(
        **VOCAB, hidden_size=1024,
        layers_block_type=[NEMOTRON_LAYERS[c] for c in "MEMEM*EMEMEM*EME"],
        num_attention_heads=16, num_key_value_heads=2, head_dim=64, mamba_num_heads=32,
        mamba_head_dim=64, n_groups=8, ssm_state_size=128, n_routed_experts=32,
        num_experts_per_tok=6, moe_intermediate_size=512,
        moe_shared_expert_intermediate_size=1024, intermediate_size=2048)
    return transformers.NemotronHForCausalLM(config)


FAMILIES = {"granite": granite, "qwen3.5": qwen3_5, "qwen3.5-moe": qwen3_5_moe,
            "nemotron-h": nemotron_h}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = FAMILIES[args.family]()
    if not args.family.startswith("qwen3.5"):
        write_with_llama_cpp(model, args.out, args.type)
        return
    from tests.gguf_families import write_qwen_hybrid_gguf
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(Path(folder) / "hf")
        dense = write_qwen_hybrid_gguf(Path(folder) / "hf", Path(folder) / "f32.gguf")
        quantize(dense, args.out, args.type)


if __name__ == "__main__":
    main()

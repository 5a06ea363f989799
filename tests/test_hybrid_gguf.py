"""A hybrid's GGUF file (llama.cpp's `granitehybrid`, `qwen35`, `qwen35moe`, `qwen3next`,
`nemotron_h`, `nemotron_h_moe`),
written here as llama.cpp's converter writes it (tests.gguf_families) from a tiny random
transformers model: the config read from the file's metadata, the tensors brought back to the
checkpoint's conventions, the linear weights kept as blocks under --quantization gguf."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from minisgl.engine import Engine, EngineConfig
from tests.engine_probe import prefill_logits
from tests.gguf_families import (write_granite_hybrid_gguf, write_nemotron_h_gguf,
                                 write_qwen_hybrid_gguf)
from tests.test_hybrid import FAMILIES, GRANITE, assert_logits_match_across_spans, random_prompts
from tests.test_nemotron_h import save_nemotron
from tests.test_moe import BF16_REL_BOUND
from tests.test_quantization import relative_error

VOCAB = 49152  # the bundled tokenizer's, which the file carries
VARIANTS = {  # experts and NoPE (Granite 4.0-H-Tiny's kind); dense with RoPE (Bamba's kind)
    "experts": {"num_local_experts": 4},
    "dense-rope": {"num_local_experts": 0, "position_embedding_type": "rope"},
}


def save_granite(folder: Path, **fields) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.GraniteMoeHybridConfig(**{**GRANITE, "vocab_size": VOCAB, **fields})
    model = transformers.GraniteMoeHybridForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith(".D"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return model


def save_qwen(family: str, folder: Path, **fields) -> torch.nn.Module:
    import transformers
    model_class, config_class, shape = FAMILIES[family]
    shape = {k: v for k, v in shape.items() if k != "mlp_only_layers"}  # none in llama.cpp's
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**shape, "vocab_size": VOCAB, **fields})
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return model


# qwen35moe: qwen35's layers with qwen3next's experts
@pytest.mark.parametrize("family", ["qwen3.5", "qwen3-next"])
def test_a_qwen_hybrid_gguf_file_serves_transformers_logits(family, tmp_path) -> None:
    """F32 file (4 value heads over 2 key heads: Qwen3.5's are tiled in the file)."""
    model = save_qwen(family, tmp_path / "hf")
    gguf = write_qwen_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    assert_logits_match_across_spans(model, str(gguf), [(0, 7), (7, 23), (23, 24), (24, 40)])


def test_a_qwen3_5_q8_0_file_keeps_its_tiled_projections_as_blocks(tmp_path) -> None:
    """--quantization gguf: the DeltaNet's projections are blocks (their value-head rows
    reordered, the output projection taking them tiled; in_proj_a / in_proj_b too, quantized
    as llama-quantize does), with the logits of the same file dequantized (bfloat16 both;
    bound BF16_REL_BOUND)."""
    # 8 value heads: in_proj_a / in_proj_b's rows fill the block kernels' 8-row layout
    save_qwen("qwen3.5", tmp_path / "hf", linear_num_value_heads=8)
    gguf = write_qwen_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                  GGMLQuantizationType.Q8_0, gate_blocks=True)

    def check(engine: Engine, blocks: bool) -> None:
        mixer = engine.model.layers[0].linear_attn
        assert engine.arch.linear.tiled
        assert [not isinstance(m.weight, torch.nn.Parameter) for m in
                (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_a, mixer.in_proj_b,
                 mixer.out_proj)] == [blocks] * 5

    assert_blocks_give_the_dequantized_logits(gguf, check)


def assert_blocks_give_the_dequantized_logits(gguf: Path, check, dtype: str = "bfloat16",
                                              bound: float = BF16_REL_BOUND) -> None:
    """The file's logits with --quantization gguf and none (`dtype` both) within `bound`
    (relative L2); `check(engine, blocks)` looks at each engine's layers."""
    ids = random_prompts((40,))[0]
    logits = {}
    for method in ("gguf", "none"):
        engine = Engine(EngineConfig(model_path=str(gguf), dtype=dtype, quantization=method,
                                     max_total_tokens=256))
        check(engine, method == "gguf")
        logits[method] = prefill_logits(engine, ids).float()
        engine.shutdown()
    assert relative_error(logits["gguf"], logits["none"]) < bound


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_granite_hybrid_gguf_file_serves_transformers_logits(variant, tmp_path) -> None:
    """F32 file: chunks and decodes give transformers' logits on the original checkpoint (the
    rotary variant shows that the q / k rows come back in their order)."""
    model = save_granite(tmp_path / "hf", **VARIANTS[variant])
    gguf = write_granite_hybrid_gguf(tmp_path / "hf", tmp_path / f"tiny-{variant}.gguf")
    assert_logits_match_across_spans(model, str(gguf), [(0, 7), (7, 23), (23, 24), (24, 40)])


def test_gguf_quantization_keeps_the_hybrid_linears_as_blocks(tmp_path) -> None:
    """--quantization gguf on a Q8_0 file: the Mamba2 projections, attention, shared MLP and
    experts hold blocks (no dense weight), with the logits of the same file dequantized
    (bfloat16 both; bound BF16_REL_BOUND)."""
    # blocks of 32 along every input, rows by 8 (the Mamba2 projection's: 2 x 128 + 64 + 8)
    save_granite(tmp_path / "hf", num_local_experts=4, shared_intermediate_size=64,
                 mamba_n_heads=8, mamba_d_head=16)
    gguf = write_granite_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                     GGMLQuantizationType.Q8_0)

    def check(engine: Engine, blocks: bool) -> None:
        mamba, attention = engine.model.layers[0], engine.model.layers[1]
        dense = {name: isinstance(getattr(module, "weight", None), torch.nn.Parameter)
                 for name, module in (("in_proj", mamba.mamba.in_proj),
                                      ("out_proj", mamba.mamba.out_proj),
                                      ("qkv", attention.self_attn.qkv_proj),
                                      ("shared", mamba.shared_mlp.gate_up_proj))}
        assert set(dense.values()) == {not blocks}, dense
        assert (mamba.mlp.experts.gate_up is None) == blocks

    assert_blocks_give_the_dequantized_logits(gguf, check)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_nemotron_h_gguf_file_serves_transformers_logits(family, tmp_path) -> None:
    """F32 `nemotron_h` / `nemotron_h_moe` file: each block's mixer (Mamba2, attention, MLP,
    experts) told by its tensors, the experts' grouped routing by the expert_* keys."""
    model = save_nemotron(tmp_path / "hf", family, vocab_size=VOCAB)
    gguf = write_nemotron_h_gguf(tmp_path / "hf", tmp_path / f"tiny-{family}.gguf")
    assert_logits_match_across_spans(model, str(gguf), [(0, 7), (7, 23), (23, 24), (24, 40)])


@pytest.mark.parametrize("experts_kind", ["Q8_0", "Q4_K"])
def test_a_nemotron_h_q8_0_file_keeps_every_projection_and_expert_as_blocks(experts_kind,
                                                                           tmp_path) -> None:
    """--quantization gguf: Mamba2's in / out projections, attention, the MLP, the shared
    expert and the experts (Q8_0, or a k-quant: the block kernel's, one weight per expert)
    hold blocks, with the logits of the same file dequantized (bfloat16 both; bound
    BF16_REL_BOUND)."""
    # blocks of 32 along every input (256: a k-quant's), rows by 8 (Mamba2's in_proj: 2 x 128
    # + 64 + 8); every token takes every expert, so that no near-tie of the router's scores
    # flips a choice between the two roundings (the blocks' products are what is compared)
    save_nemotron(tmp_path / "hf", "moe", vocab_size=VOCAB, mamba_num_heads=8, hidden_size=256,
                  moe_intermediate_size=256, moe_shared_expert_intermediate_size=64,
                  num_experts_per_tok=8, n_group=1, topk_group=1)
    gguf = write_nemotron_h_gguf(tmp_path / "hf", tmp_path / f"tiny.{experts_kind}.gguf",
                                 GGMLQuantizationType.Q8_0, GGMLQuantizationType[experts_kind])

    def check(engine: Engine, blocks: bool) -> None:
        mamba, experts, attention, mlp = (engine.model.layers[i].mixer if i != 2 else
                                          engine.model.layers[i].self_attn for i in range(4))
        dense = {name: isinstance(getattr(module, "weight", None), torch.nn.Parameter)
                 for name, module in (("in_proj", mamba.in_proj), ("out_proj", mamba.out_proj),
                                      ("qkv", attention.qkv_proj), ("mlp", mlp.up_proj),
                                      ("shared", experts.shared_experts.down_proj))}
        assert set(dense.values()) == {not blocks}, dense
        assert (experts.experts.gate_up is None) == blocks
        if blocks and experts_kind.endswith("_K"):  # one k-quant weight per expert and part
            assert {w.kind for parts in experts.experts.quantized.parts for w in parts} == {
                experts_kind}

    assert_blocks_give_the_dequantized_logits(gguf, check)


def test_an_unknown_metadata_key_of_the_family_is_refused(tmp_path) -> None:
    from gguf import GGUFReader, GGUFWriter
    save_granite(tmp_path / "hf", num_local_experts=0)
    source = write_granite_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(tmp_path / "yarn.gguf"), "granitehybrid")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 sub_type=field.types[1] if len(field.types) > 1 else None)
    writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.YARN)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="rope.scaling.type"):
        Engine(EngineConfig(model_path=str(tmp_path / "yarn.gguf"), dtype="float32",
                            max_total_tokens=64))

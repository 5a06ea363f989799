"""The linear layers alone, per weight form: ms per pass over the 30 layers' four linears of the
bundled model's shapes (random weights, so the weights stream from memory as in a step).

    python -m minisgl.bench linears                      # rows 1 8 64 512 2048
    python -m minisgl.bench linears --rows 64 --rounds 3
    python -m minisgl.bench linears --rows 64 96 128 --kernel-max-rows 0   # GGUF: always GEMM
    python -m minisgl.bench linears --lm-head --rows 1 32 64 512   # the LM head's forms
    python -m minisgl.bench linears --threads 1 --forms Q4_K_M/1 gguf-4bit/1   # one core

Forms: `bf16` (the prepacked oneDNN GEMM, `--quantization none`), `gguf-4bit` (4-bit blocks
through quant_matmul, dequantized for a GEMM past VNNI_MAX_ROWS), `Q5_0` and `Q4_K_M` (GGUF
blocks through block_matmul, dequantized for a GEMM past its KERNEL_MAX_ROWS; Q4_K_M as
llama.cpp lays out the bundled model: down Q4_K, the rest Q5_0), `gguf-4bit/1` and
`Q4_K_M/1` (the same with one-int8-term activations, --cpu-int8-activations), `w8a8`
(int8_matmul, an activation scale per 32 inputs, as `--quantization w8a8_int8` runs),
`w8a8-per-token` (one activation scale per row, as SGLang's w8a8_int8 quantizes).

Without AVX-512 VNNI (plain AVX2) the activations are float32 and the forms those such a CPU
serves: `f32` (the dense float32 GEMM, `--quantization none`), `Q4_1` (the bundled model's type),
`Q5_0` and `Q4_K_M` through block_matmul's AVX2 path.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from minisgl.layers import gguf_weight
from minisgl.layers.gguf_weight import GROUP, KINDS, SUPER, GgufBlocks, GgufWeight
from minisgl.layers.linear import pack_weight
from minisgl.layers.quant import (BlockWeight, WeightBlocks, activation_terms, block_weight,
                                  int8_weight, vnni_kernels)
from minisgl.layers.w8a8 import Int8ChannelWeight

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
HEAD_SHAPE = (49152, 576)


def random_4bit(out_features: int, in_features: int) -> BlockWeight:
    scales = torch.rand(out_features, in_features // 32) * 0.01
    codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
    return block_weight(WeightBlocks(codes, scales, torch.zeros_like(scales)), torch.bfloat16)


def random_gguf(kind: str, out_features: int, in_features: int) -> GgufWeight:
    """Random codes and scales of a 4- to 6-bit GGUF kind (Q5_0, Q4_K ...)."""
    bits, _ = KINDS[kind]
    codes = torch.randint(0, 1 << bits, (out_features, in_features), dtype=torch.uint8)
    per_scale = SUPER if kind.endswith("_K") else GROUP
    scales = torch.rand(out_features, in_features // per_scale, 2) * 0.01
    if kind in ("Q4_0", "Q5_0"):  # the offset the type fixes
        scales = scales.half().float()
        scales[..., 1] = -(1 << (bits - 1)) * scales[..., 0]
    subs = (torch.randint(0, 64, (out_features, in_features // GROUP, 2), dtype=torch.int16)
            if kind.endswith("_K") else None)
    return GgufWeight(GgufBlocks(kind, codes, scales.half().float(), subs))


def avx2_forms() -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Per form a CPU without VNNI serves, one matmul per (layer, linear)."""
    out: dict[str, list] = {"f32": [], "Q4_1": [], "Q5_0": [], "Q4_K_M": []}
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            dense = torch.randn(out_features, in_features) * 0.05
            out["f32"].append(lambda x, w=dense: torch.nn.functional.linear(x, w))
            out["Q4_1"].append(random_gguf("Q4_1", out_features, in_features).matmul)
            q5_0 = random_gguf("Q5_0", out_features, in_features).matmul
            out["Q5_0"].append(q5_0)
            out["Q4_K_M"].append(random_gguf("Q4_K", out_features, in_features).matmul
                                 if in_features % SUPER == 0 else q5_0)
    return out


def forms() -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Per form, one matmul per (layer, linear)."""
    out: dict[str, list] = {"bf16": [], "gguf-4bit": [], "gguf-4bit/1": [], "Q5_0": [],
                            "Q4_K_M": [], "Q4_K_M/1": [], "w8a8": [], "w8a8-per-token": []}
    kernels = vnni_kernels()
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            dense = torch.randn(out_features, in_features) * 0.05
            packed = pack_weight(dense.to(torch.bfloat16))
            out["bf16"].append(lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], ""))
            out["gguf-4bit"].append(random_4bit(out_features, in_features).matmul)
            q5_0 = random_gguf("Q5_0", out_features, in_features).matmul
            out["Q5_0"].append(q5_0)
            out["Q4_K_M"].append(random_gguf("Q4_K", out_features, in_features).matmul
                                 if in_features % SUPER == 0 else q5_0)
            with activation_terms(1):
                out["gguf-4bit/1"].append(random_4bit(out_features, in_features).matmul)
                kind = "Q4_K" if in_features % SUPER == 0 else "Q5_0"
                out["Q4_K_M/1"].append(random_gguf(kind, out_features, in_features).matmul)
            int8 = Int8ChannelWeight(dense)
            out["w8a8"].append(int8.matmul)
            out["w8a8-per-token"].append(lambda x, w=int8: kernels.int8_matmul(
                x, w.codes, w.scales, w.in_features))
    return out


def head_forms() -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """The bundled model's LM head (49152 x 576) as the VNNI CPU serves it: its 8-bit copy with
    two or one activation terms, and the prepacked bfloat16 GEMM."""
    dense = torch.randn(*HEAD_SHAPE) * 0.05
    with activation_terms(1):
        one = int8_weight(dense)
    packed = pack_weight(dense.to(torch.bfloat16))
    return {"bf16": [lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [],
                                                                  "")],
            "int8-copy": [int8_weight(dense).matmul], "int8-copy/1": [one.matmul]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5, help="passes per figure (the best)")
    parser.add_argument("--rounds", type=int, default=1, help="the whole table this many times")
    parser.add_argument("--lm-head", action="store_true",
                        help="the LM head's forms instead of the 120 linears (VNNI only)")
    parser.add_argument("--forms", nargs="+", default=None, help="only these forms")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's threads (1: one core, steadier on a shared machine)")
    parser.add_argument("--kernel-max-rows", type=int, default=None,
                        help="the GGUF forms' crossover to dequantize + GEMM (0: always the "
                             "GEMM; default: gguf_weight.KERNEL_MAX_ROWS)")
    args = parser.parse_args()
    if args.kernel_max_rows is not None:
        gguf_weight.KERNEL_MAX_ROWS = args.kernel_max_rows
        gguf_weight.AVX2_KERNEL_MAX_ROWS = args.kernel_max_rows
        gguf_weight.ONE_TERM_MAX_ROWS = args.kernel_max_rows
    if args.threads:
        torch.set_num_threads(args.threads)
    vnni = vnni_kernels() is not None
    torch.manual_seed(0)
    matmuls = head_forms() if args.lm_head else forms() if vnni else avx2_forms()
    if args.forms:
        matmuls = {name: matmuls[name] for name in args.forms}
    shapes = [HEAD_SHAPE] if args.lm_head else SHAPES * LAYERS
    dense, fastest = (("bf16", "int8-copy/1") if args.lm_head else ("bf16", "w8a8") if vnni
                      else ("f32", "Q4_1"))
    dtype = torch.bfloat16 if vnni else torch.float32
    ratio = dense in matmuls and fastest in matmuls
    print("| rows | " + " | ".join(matmuls) + (f" | {dense} / {fastest} |" if ratio else " |"))
    print("|---|" + "---|" * (len(matmuls) + ratio))
    for _ in range(args.rounds):
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {s[1] for s in shapes}}
            ms = {}
            for name, calls in matmuls.items():
                def one_pass() -> None:
                    for call, (_, in_features) in zip(calls, shapes):
                        call(inputs[in_features])
                one_pass()
                best = float("inf")
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    one_pass()
                    best = min(best, time.perf_counter() - started)
                ms[name] = best * 1e3
            print(f"| {rows} | " + " | ".join(f"{v:.2f}" for v in ms.values())
                  + (f" | {ms[dense] / ms[fastest]:.2f}x |" if ratio else " |"), flush=True)


if __name__ == "__main__":
    main()

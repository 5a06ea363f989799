"""The CUDA path of quantized checkpoints (layers.gpu_blocks) end to end without a GPU: the
bundled model written as an AWQ / GPTQ / compressed-tensors / block-fp8 checkpoint
(tests.hf_quant_writers), loaded by the real loader into the CUDA forms (kept on CPU), every
linear through the Triton kernels under the interpreter, greedy tokens and logprobs against
transformers in float32 on the weights the checkpoint encodes. Float32 activations: the
kernels are exact up to float32 sums, so the bounds are tight (margin 1e-3, logprobs 1e-4).

    python scripts/check_gpu_blocks_interpreted.py awq 64          # ~2-4 min each on 2 cores
    python scripts/check_gpu_blocks_interpreted.py gptq 32 --symmetric
    python scripts/check_gpu_blocks_interpreted.py compressed-tensors -1 --symmetric
    python scripts/check_gpu_blocks_interpreted.py fp8 0

What stands in for the GPU (and only that): the device the loader is told (CPU tensors, the
CUDA forms), one fixed tile config per kernel instead of the autotuner (which times on a GPU),
and the kernels' row limit raised so prefill runs them too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from minisgl.kernels import fp8_matmul, int4_matmul  # noqa: E402
from minisgl.layers import fp8 as fp8_layer  # noqa: E402
from minisgl.layers import gpu_blocks, linear, moe  # noqa: E402
from minisgl.models import hf_quant, loader  # noqa: E402


def fixed_config(m: int, block_k: int) -> dict:
    return (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, DOT=True) if m > 1 else
            dict(BLOCK_M=1, BLOCK_N=128, BLOCK_K=block_k, DOT=False))


def int4_untuned(x, words, scales, zeros):
    m, k = x.shape
    n, group = words.shape[0], k // scales.shape[1]
    cfg = fixed_config(m, 128 if group == k else min(128, group))
    out = torch.empty((m, n), dtype=x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    int4_matmul._int4_matmul_kernel.fn[grid](x, words, scales, zeros, out, m, n, k, m, group,
                                             x.stride(0), words.stride(0), scales.stride(0),
                                             out.stride(0), **cfg)
    return out


def fp8_untuned(x, codes, scales, scale_group=0):
    m, k = x.shape
    n = codes.shape[0]
    cfg = fixed_config(m, 128)
    out = torch.empty((m, n), dtype=x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    fp8_matmul._fp8_matmul_kernel.fn[grid](x, codes, scales, out, m, n, k, m, x.stride(0),
                                           codes.stride(0), out.stride(0), scales.stride(0),
                                           scale_group, **cfg)
    return out


def stand_in_for_the_gpu() -> None:
    int4_matmul.int4_matmul, fp8_matmul.fp8_matmul = int4_untuned, fp8_untuned
    gpu_blocks.KERNEL_MAX_ROWS = fp8_layer.KERNEL_MAX_ROWS = 1 << 30
    def cuda_form(slots: object, device: torch.device) -> object:  # built on the CPU
        return gpu_blocks.gpu_block_weight(slots, torch.device("cpu"))

    linear.finished_weight = moe.finished_weight = cuda_form  # linears' and experts'
    reader = hf_quant.QuantizedReader
    loader.QuantizedReader = lambda folder, spec, device: reader(folder, spec,
                                                                 torch.device("meta"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=hf_quant.METHODS)
    parser.add_argument("group", type=int, help="int4 group size (-1: a row); fp8: any")
    parser.add_argument("--symmetric", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=4)
    args = parser.parse_args()
    stand_in_for_the_gpu()
    from transformers import AutoModelForCausalLM

    from minisgl import LLM
    from tests import reference as ref
    from tests.hf_quant_writers import write_checkpoint
    from tests.test_gguf_types import assert_matches_transformers
    folder, dense = write_checkpoint(Path(tempfile.mkdtemp()), args.method, args.group,
                                     args.symmetric)
    prompts = [ref.prompt_ids(ref.PLAIN_PROMPTS[0])]
    with LLM(str(folder), dtype="float32", max_total_tokens=1024, max_running_requests=2) as llm:
        form = llm.runtime.engine.model.layers[0].self_attn.qkv_proj.quantized
        assert isinstance(form, (gpu_blocks.Int4GroupWeight, fp8_layer.Fp8ChannelWeight)), form
        outs = llm.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                            sampling_params={"temperature": 0, "ignore_eos": True,
                                             "max_new_tokens": args.new_tokens})
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out, 1e-3, 1e-4)
        print(f"{args.method} group {args.group}: {type(form).__name__}, tokens "
              f"{out['output_ids']} match transformers (margin 1e-3, logprobs 1e-4)")


if __name__ == "__main__":
    main()

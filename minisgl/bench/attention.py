"""The CPU attention kernel alone, per layer: decode over scattered pages (16 tokens unless
--page says otherwise), and prefill
against SDPA's fused CPU kernel (GQA heads repeated, as the torch backend ran it before).

    python -m minisgl.bench attention                       # SmolLM2's heads, bfloat16
    python -m minisgl.bench attention --heads 32 --kv-heads 8 --head-dim 128
    python -m minisgl.bench attention --decode-only --page 16 64   # page sizes side by side

Decode is timed two ways: one layer repeated (its KV stays in L3) and 30 layers in turn (the
KV comes from DRAM, as in serving).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from minisgl.kernels import cpu_kernels


def per_call_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(2):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--page", type=int, nargs="+", default=[16],
                        help="KV page sizes for decode, timed in turn")
    parser.add_argument("--decode-only", action="store_true",
                        help="skip prefill (a kernel from before prefill went through it)")
    args = parser.parse_args()
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = args.heads, args.kv_heads, args.head_dim, args.head_dim ** -0.5
    layers, pool = 30, 65536
    kv = torch.randn(2, layers, kv_heads, pool, dim).bfloat16()
    q = torch.randn(args.batch, heads, dim).bfloat16()
    lens = torch.full((args.batch,), args.context)
    for page in args.page:
        pages = torch.randperm(pool // page)[: args.batch * args.context // page]
        locations = (pages.view(args.batch, -1)[:, :, None] * page + torch.arange(page)).view(
            args.batch, -1)
        one = per_call_ms(lambda: kernels.decode_attention(q, kv[0, 0], kv[1, 0], locations,
                                                           lens, scale), 100)
        turn = iter(range(10 ** 9))

        def next_layer() -> object:
            layer = next(turn) % layers
            return kernels.decode_attention(q, kv[0, layer], kv[1, layer], locations, lens,
                                            scale)

        cycled = per_call_ms(next_layer, 150)
        print(f"decode, {args.batch} x {args.context} tokens in {page}-token pages, "
              f"{heads}/{kv_heads} heads x {dim}: {one:.3f} ms per layer (one layer repeated), "
              f"{cycled:.3f} ms (30 layers in turn)")

    if args.decode_only:
        return
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    group = heads // kv_heads
    print("| prompts x tokens | kernel ms | SDPA flash ms | ratio |\n|---|---|---|---|")
    for prompts, length in [(64, 128), (16, 512), (4, 1024), (1, 2048), (1, 8192)]:
        tokens = prompts * length
        k_cache, v_cache = kv[0, 0, :, :tokens], kv[1, 0, :, :tokens]
        table = torch.arange(tokens).view(prompts, length)
        qt = torch.randn(tokens, heads, dim).bfloat16()
        rows = torch.arange(prompts).repeat_interleave(length)
        positions = torch.arange(length).repeat(prompts) + 1
        ks = k_cache.view(kv_heads, prompts, length, dim).transpose(0, 1)
        vs = v_cache.view(kv_heads, prompts, length, dim).transpose(0, 1)
        qs = qt.view(prompts, length, heads, dim).transpose(1, 2)
        calls = 1 if tokens > 4096 else 5
        ours = per_call_ms(lambda: kernels.decode_attention(
            qt, kv[0, 0], kv[1, 0], table, positions, scale, rows), calls)
        sdpa = per_call_ms(lambda: flash(qs, ks.repeat_interleave(group, 1),
                                         vs.repeat_interleave(group, 1), 0.0, True,
                                         scale=scale), calls)
        print(f"| {prompts} x {length} | {ours:.1f} | {sdpa:.1f} | {sdpa / ours:.1f}x |")


if __name__ == "__main__":
    main()

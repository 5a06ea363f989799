"""The CPU attention kernel alone, per layer: decode over scattered pages (16 tokens unless
--page says otherwise), and prefill
against SDPA's fused CPU kernel (GQA heads repeated, as the torch backend ran it before).

    python -m minisgl.bench attention                       # SmolLM2's heads, bfloat16
    python -m minisgl.bench attention --heads 32 --kv-heads 8 --head-dim 128
    python -m minisgl.bench attention --decode-only --page 16 64   # page sizes side by side
    python -m minisgl.bench attention --pages bfloat16 int8 --context 2048  # --kv-cache-dtype

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
    parser.add_argument("--pages", nargs="+", default=["bfloat16"],
                        choices=["bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"],
                        help="what the KV pages hold (--kv-cache-dtype), timed in turn")
    parser.add_argument("--decode-only", action="store_true",
                        help="skip prefill (a kernel from before prefill went through it)")
    args = parser.parse_args()
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels did not build"
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = args.heads, args.kv_heads, args.head_dim, args.head_dim ** -0.5
    layers = 30
    pool = max(65536, 2 * args.batch * args.context)
    q = torch.randn(args.batch, heads, dim).bfloat16()
    lens = torch.full((args.batch,), args.context)
    stored = {name: stored_pages(kernels, getattr(torch, name), layers, kv_heads, pool, dim)
              for name in args.pages}
    for name, (kv, scales) in stored.items():
        for page in args.page:
            pages = torch.randperm(pool // page)[: args.batch * args.context // page]
            locations = (pages.view(args.batch, -1)[:, :, None] * page
                         + torch.arange(page)).view(args.batch, -1)

            def layer_call(layer: int) -> object:
                return kernels.decode_attention(q, kv[0, layer], kv[1, layer], locations, lens,
                                                scale, k_scales=scales[0][layer],
                                                v_scales=scales[1][layer])

            one = per_call_ms(lambda: layer_call(0), 100)
            turn = iter(range(10 ** 9))
            cycled = per_call_ms(lambda: layer_call(next(turn) % layers), 150)
            print(f"decode, {args.batch} x {args.context} tokens in {page}-token {name} pages, "
                  f"{heads}/{kv_heads} heads x {dim}: {one:.3f} ms per layer (one layer "
                  f"repeated), {cycled:.3f} ms (30 layers in turn)")

    if args.decode_only:
        return
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    group = heads // kv_heads
    print(f"prefill, the kernel per page dtype against SDPA's flash kernel (bfloat16)\n"
          f"| prompts x tokens | {' | '.join(f'kernel, {n} pages, ms' for n in stored)} | "
          f"SDPA flash ms | ratio (first pages) |\n|---|{'---|' * len(stored)}---|---|")
    for prompts, length in [(64, 128), (16, 512), (4, 1024), (1, 2048), (1, 8192)]:
        tokens = prompts * length
        table = torch.arange(tokens).view(prompts, length)
        qt = torch.randn(tokens, heads, dim).bfloat16()
        rows = torch.arange(prompts).repeat_interleave(length)
        positions = torch.arange(length).repeat(prompts) + 1
        calls = 1 if tokens > 4096 else 5
        ours = [per_call_ms(lambda: kernels.decode_attention(
            qt, kv[0, 0], kv[1, 0], table, positions, scale, rows, k_scales=scales[0][0],
            v_scales=scales[1][0]), calls) for kv, scales in stored.values()]
        kv, scales = next(iter(stored.values()))
        k_cache, v_cache = (kv[i, 0, :, :tokens].float() if scales[i][0] is None else
                            kv[i, 0, :, :tokens] * scales[i][0][:, :tokens, None]
                            for i in (0, 1))
        ks = k_cache.bfloat16().view(kv_heads, prompts, length, dim).transpose(0, 1)
        vs = v_cache.bfloat16().view(kv_heads, prompts, length, dim).transpose(0, 1)
        qs = qt.view(prompts, length, heads, dim).transpose(1, 2)
        sdpa = per_call_ms(lambda: flash(qs, ks.repeat_interleave(group, 1),
                                         vs.repeat_interleave(group, 1), 0.0, True,
                                         scale=scale), calls)
        print(f"| {prompts} x {length} | {' | '.join(f'{ms:.1f}' for ms in ours)} | "
              f"{sdpa:.1f} | {sdpa / ours[0]:.1f}x |")


def stored_pages(kernels, dtype: torch.dtype, layers: int, kv_heads: int, pool: int, dim: int
                 ) -> tuple[torch.Tensor, tuple[list, list]]:
    """[2, layers, kv_heads, pool, dim] pages of random K/V stored as `dtype` (through the
    kernel's store), and per half and layer the int8 pages' scales (else None)."""
    kv = torch.empty(2, layers, kv_heads, pool, dim, dtype=dtype)
    int8 = dtype == torch.int8
    scales = tuple([torch.zeros(kv_heads, pool) if int8 else None for _ in range(layers)]
                   for _ in range(2))
    everywhere = torch.arange(pool)
    for layer in range(layers):
        values = torch.randn(2, pool, kv_heads, dim).bfloat16()
        if dtype == torch.bfloat16:
            kv[:, layer] = values.transpose(1, 2)
            continue
        kernels.store_kv_(kv[0, layer], kv[1, layer], everywhere, values[0], values[1],
                          scales[0][layer], scales[1][layer])
    return kv, scales


if __name__ == "__main__":
    main()

"""A mixture-of-experts decode step against the dense model of equal active parameters, side by
side in one run (model forward only, random weights, the shipped real shapes with few layers).

    python -m minisgl.bench moe                                   # qwen3-30b-a3b, 2 layers
    python -m minisgl.bench moe --config mixtral-8x7b --layers 1 --steps 5
    MINISGL_DISABLE_CPU_KERNELS=1 python -m minisgl.bench moe   # torch's grouped matmul
    python -m minisgl.bench moe --kernel   # the experts' matmul alone: ours vs torch's
    python -m minisgl.bench moe --lora --rows 1 32 64   # 0, 1 and 8 adapters on every linear

The dense equivalent keeps the attention and swaps each layer's experts for one MLP as wide as
the k experts a token goes to (Qwen3-30B-A3B: 8 x 768 = 6144; Mixtral: 2 x 14336), so both read
the same weights per token at one row. At more rows the experts' rows spread over many experts,
each of whose weights is read: the column "experts read" is the expected number per layer,
E * (1 - (1 - k / E) ** rows), and "MoE / dense" is bounded below by the bytes each reads.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from minisgl.bench.decode_step import decode_batch, decode_step_seconds
from minisgl.engine import Engine, EngineConfig
from minisgl.models.arch import ModelArch
from minisgl.models.weights import load_config, resolve_model_path

DENSE_ARCHITECTURE = {"Qwen3MoeForCausalLM": ("Qwen3ForCausalLM", "qwen3"),
                      "MixtralForCausalLM": ("MistralForCausalLM", "mistral")}


def build(config: str, overrides: dict, args: argparse.Namespace, **flags) -> Engine:
    most = max(args.rows)
    return Engine(EngineConfig(
        model_path=config, load_format="dummy", dtype=args.dtype, max_running_requests=most,
        max_total_tokens=most * (args.context + 8) + 16,
        json_model_override_args=json.dumps({"num_hidden_layers": args.layers,
                                             "vocab_size": args.vocab, **overrides}), **flags))


LORA_RANK, LORA_SLOTS, ROUNDS = 16, 8, 3


def lora_table(args: argparse.Namespace) -> None:
    """The MoE decode step with rank-16 adapters on every linear and every expert (random
    weights written straight into the slots): rows of 0, 1 or 8 distinct adapters in one
    engine (0: the base model's work), and the model without --enable-lora built first."""
    from minisgl.engine.lora import lora_step
    from minisgl.layers.lora import ExpertLora
    times: dict[str, dict[int, float]] = {}
    plain = build(args.config, {}, args)
    times["no --enable-lora"] = {rows: decode_step_seconds(plain, rows, args.context,
                                                           args.steps) * 1e3
                                 for rows in args.rows}
    plain.shutdown()
    del plain
    engine = build(args.config, {}, args, enable_lora=True, max_lora_rank=LORA_RANK,
                   max_loras_per_batch=LORA_SLOTS, lora_target_modules=["all"])
    lora = engine.lora
    tensors = [t for b in lora.buffers
               for t in (b.tensors if isinstance(b, ExpertLora) else (b.a, *b.b))]
    gen = torch.Generator().manual_seed(0)
    for tensor in tensors:
        tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.02)
    print(f"LoRA buffers: {sum(t.nbytes for t in tensors) / 1e6:.0f} MB", flush=True)
    for _ in range(ROUNDS):  # NOTE: alternated, the best of each: this machine's speed moves
        for adapters in (0, 1, LORA_SLOTS):
            label = f"{adapters} adapters"
            for rows in args.rows:
                batch, _ = decode_batch(engine, rows, args.context)
                batch.lora_slots = [i % adapters if adapters else -1 for i in range(rows)]
                lora.context.step = lora_step(batch, lora.layout, engine.dtype)
                ms = decode_step_seconds(engine, rows, args.context, args.steps) * 1e3
                times.setdefault(label, {})[rows] = min(times.get(label, {}).get(rows, ms), ms)
    engine.shutdown()
    print(f"\n{args.config}, {args.layers} layers, vocabulary {args.vocab}, rank {LORA_RANK}, "
          f"context {args.context}, {torch.get_num_threads()} threads; decode step ms")
    print("| rows | " + " | ".join(times) + f" | {LORA_SLOTS} adapters / 0 |")
    print("|---|" + "---|" * (len(times) + 1))
    for rows in args.rows:
        ratio = times["0 adapters"][rows] / times[f"{LORA_SLOTS} adapters"][rows]
        print(f"| {rows} | " + " | ".join(f"{t[rows]:.1f}" for t in times.values()) +
              f" | {ratio:.2f}x |")


def kernel_table() -> None:
    """One grouped matmul at each expert's weight shape (Mixtral's gate/up, Qwen3-30B-A3B's),
    as many experts as a 32-row step reads, at 1..32 rows per expert: our kernel against
    torch's grouped matmul, as weight GB/s."""
    from minisgl.kernels import cpu_kernels
    kernels = cpu_kernels()
    print("| experts x weight | rows / expert | ours ms | GB/s | torch._grouped_mm ms | GB/s |")
    print("|---|---|---|---|---|---|")
    for experts, out_features, in_features in ((2, 2 * 14336, 4096), (16, 1536, 2048)):
        weight = torch.randn(experts, out_features, in_features) * 0.02
        gigabytes = weight.numel() * weight.element_size() / 1e9
        for rows in (1, 2, 4, 8, 16, 32):
            x = torch.randn(experts * rows, in_features)
            ends = torch.arange(1, experts + 1, dtype=torch.int32) * rows
            ours = best_ms(lambda: kernels.expert_matmul(x, weight, ends))
            theirs = best_ms(lambda: torch._grouped_mm(x, weight.transpose(1, 2), offs=ends))
            print(f"| {experts} x {out_features}x{in_features} | {rows} | {ours:.1f} | "
                  f"{gigabytes / ours * 1e3:.1f} | {theirs:.1f} | {gigabytes / theirs * 1e3:.1f} |",
                  flush=True)


def best_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--vocab", type=int, default=32000,
                        help="a smaller head than Qwen3's 152k keeps the layers the bulk")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kernel", action="store_true", help="the experts' matmul alone")
    parser.add_argument("--lora", action="store_true", help="with adapters on the experts")
    args = parser.parse_args()
    if args.kernel:
        return kernel_table()
    if args.lora:
        return lora_table(args)
    arch = ModelArch.from_config(load_config(resolve_model_path(args.config)))
    moe = arch.moe
    assert moe is not None, f"{args.config} is not a mixture of experts"
    architecture, model_type = DENSE_ARCHITECTURE[arch.architecture]
    dense_overrides = {"architectures": [architecture], "model_type": model_type,
                       "intermediate_size": moe.top_k * moe.intermediate_size,
                       "num_experts": 0, "num_local_experts": 0}
    times: dict[str, dict[int, float]] = {}
    for name, overrides in (("moe", {}), ("dense", dense_overrides)):
        engine = build(args.config, overrides, args)
        params = sum(p.numel() for p in engine.model.parameters())
        print(f"{name}: {engine.arch.architecture}, {args.layers} layers, {params / 1e9:.2f}B "
              f"parameters ({engine.dtype}), peak RSS so far "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB", flush=True)
        times[name] = {rows: decode_step_seconds(engine, rows, args.context, args.steps) * 1e3
                       for rows in args.rows}
        engine.shutdown()
        del engine
    print(f"\n{args.config}, {args.layers} layers, vocabulary {args.vocab}, {moe.num_experts} "
          f"experts, top {moe.top_k}, context {args.context}, {torch.get_num_threads()} threads")
    print("| rows | experts read / layer | MoE step ms | dense-equivalent step ms | MoE / dense |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        read = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** rows)
        print(f"| {rows} | {read:.1f} | {times['moe'][rows]:.1f} | {times['dense'][rows]:.1f} | "
              f"{times['moe'][rows] / times['dense'][rows]:.2f}x |")


if __name__ == "__main__":
    main()

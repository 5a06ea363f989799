"""A hybrid's decode step (Gated DeltaNet layers with a fixed-size state, one attention layer in
four) against the dense model of about equal parameters, side by side in one run, model
forward only, random weights; and a prompt through one layer's delta rule in its two torch
forms and in the CPU span kernel.

    python -m minisgl.bench hybrid                        # 1 / 32 / 64 rows at 512, 1 / 32 at 8k
    python -m minisgl.bench hybrid --long-rows 64 --rounds 3
    python -m minisgl.bench hybrid --rows 1 8 --contexts 512 --layers 4
    python -m minisgl.bench hybrid --delta-rule-only

With the CPU kernels, the hybrid's step is timed twice, alternating: its linear layers' decode
steps on the state kernels (kernels/csrc/hybrid_state.cpp) and on torch ops. The two models
take turns for `--rounds` rounds; each cell is its fastest round (the least disturbed by other
work on the machine).

The hybrid is Qwen3.5-35B-A3B's shape (`qwen3.5-35b-a3b`) with dense MLPs of width 5632; the
dense model is Qwen3 with the same hidden size, attention shape, vocabulary and depth, its MLP
widened (7776) so that both hold the same parameters per layer (~66M) and read the same
weight bytes a step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from minisgl.bench.decode_step import decode_step_seconds
from minisgl.engine.memory import decode_weight_bytes
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels.cpu import cpu_kernels
from minisgl.models import qwen3_next
from minisgl.models.qwen3_next import chunked_gated_delta_rule, gated_delta_rule, l2_normalized

SHARED = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
          "head_dim": 256, "vocab_size": 248320}
HYBRID = ("qwen3.5-35b-a3b", {"num_experts": 0, "intermediate_size": 5632})
DENSE = ("qwen3-0.6b", {"intermediate_size": 7776, "tie_word_embeddings": False})


def model_engine(name: str, fields: dict, layers: int, rows: int, context: int) -> Engine:
    overrides = {**SHARED, **fields, "num_hidden_layers": layers,
                 "max_position_embeddings": max(40960, context + 16)}
    return Engine(EngineConfig(model_path=name, load_format="dummy", dtype="bfloat16",
                               json_model_override_args=json.dumps(overrides),
                               max_running_requests=rows,
                               max_total_tokens=rows * (context + 8) + 16))


def delta_rule_ms(tokens: int, heads: int, dim: int) -> tuple[float, float]:
    """(token-by-token, blocked) milliseconds of one layer's delta rule over `tokens`."""
    gen = torch.Generator().manual_seed(0)
    q = l2_normalized(torch.randn(tokens, heads, dim, generator=gen)) * dim ** -0.5
    k = l2_normalized(torch.randn(tokens, heads, dim, generator=gen))
    v = torch.randn(tokens, heads, dim, generator=gen)
    decay, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads,
                                                                        generator=gen)
    times = []
    for rule in (gated_delta_rule, chunked_gated_delta_rule):
        state = torch.zeros(heads, dim, dim)
        started = time.perf_counter()
        rule(q, k, v, decay, beta, state)
        times.append((time.perf_counter() - started) * 1e3)
    return times[0], times[1]


def span_kernel_ms(tokens: int, heads: int, dim: int) -> float | None:
    """Milliseconds of one layer's prompt through the CPU span kernel (gated_delta_spans: the
    convolution, the q / k norms and the delta rule token by token, the state in cache); None
    without the kernels."""
    kernels = cpu_kernels()
    if kernels is None:
        return None
    gen = torch.Generator().manual_seed(0)
    conv_dim = 3 * heads * dim
    mixed = torch.randn(tokens, conv_dim, generator=gen)
    weight = torch.randn(conv_dim, 1, 4, generator=gen) * 0.5
    windows, states = torch.zeros(1, conv_dim, 3), torch.zeros(1, heads, dim, dim)
    decay, beta = -torch.rand(tokens, heads, generator=gen), torch.rand(tokens, heads,
                                                                        generator=gen)
    started = time.perf_counter()
    kernels.gated_delta_spans(mixed, weight, windows, states, torch.tensor([0]),
                              torch.tensor([tokens]), decay, beta, heads)
    return (time.perf_counter() - started) * 1e3


def step_ms(engine: Engine, rows: int, context: int, steps: int, torch_steps: bool) -> float:
    """One decode step; `torch_steps`: the linear layers' decode steps on torch ops, not on the
    state kernels."""
    kernels = qwen3_next.cpu_kernels
    if torch_steps:
        qwen3_next.cpu_kernels = lambda: None
    try:
        return decode_step_seconds(engine, rows, context, steps) * 1e3
    finally:
        qwen3_next.cpu_kernels = kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="a multiple of 4")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    parser.add_argument("--long-rows", type=int, default=32,
                        help="rows at most past 4k tokens of context (the dense KV's size)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--delta-rule-only", action="store_true")
    args = parser.parse_args()

    print("| prompt tokens | delta rule token by token ms | blocked ms | ratio | span kernel ms "
          "| blocked / kernel |\n|---|---|---|---|---|---|")
    for tokens in (64, 512):
        stepped, blocked = delta_rule_ms(tokens, heads=32, dim=128)
        kernel = span_kernel_ms(tokens, heads=32, dim=128)
        print(f"| {tokens} | {stepped:.0f} | {blocked:.0f} | {stepped / blocked:.1f}x | "
              + ("- | - |" if kernel is None else f"{kernel:.0f} | {blocked / kernel:.1f}x |"),
              flush=True)
    if args.delta_rule_only:
        return
    print(f"\n{args.layers} layers, bfloat16, {torch.get_num_threads()} threads")
    both = cpu_kernels() is not None  # else the hybrid's step is the torch one already
    lines = []
    for context in args.contexts:
        rows = [r for r in args.rows if context <= 4096 or r <= args.long_rows]
        ms: dict[tuple[str, int], float] = {}
        # NOTE: one engine at a time (the dense KV at 8k is gigabytes), built again each round
        for round_ in range(args.rounds):
            for label, (name, fields) in (("dense", DENSE), ("hybrid", HYBRID)):
                engine = model_engine(name, fields, args.layers, max(rows), context)
                if context == args.contexts[0] and round_ == 0:
                    weights = decode_weight_bytes(engine.model)
                    print(f"{label}: {weights / 1e6:.0f} MB of weights read a step", flush=True)
                variants = [(label, False)] + ([("torch", True)] if label == "hybrid" and both
                                               else [])
                for r in rows:
                    for variant, torch_steps in variants:
                        ms[variant, r] = min(ms.get((variant, r), float("inf")),
                                             step_ms(engine, r, context, args.steps, torch_steps))
                engine.shutdown()
        for r in rows:
            line = (f"| {context} | {r} | {ms['dense', r]:.1f} | {ms['hybrid', r]:.1f} | "
                    f"{ms['dense', r] / ms['hybrid', r]:.2f}x |")
            if both:
                line += f" {ms['torch', r]:.1f} | {ms['dense', r] / ms['torch', r]:.2f}x |"
            lines.append(line)
    head = "| context | rows | dense step ms | hybrid step ms | dense / hybrid |"
    rule = "|---|---|---|---|---|"
    if both:
        head += " hybrid, torch state steps ms | dense / it |"
        rule += "---|---|"
    print(f"\n{head}\n{rule}")
    print("\n".join(lines))

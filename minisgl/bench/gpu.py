"""GPU benchmarks (CUDA only), all on dummy weights from the shipped shape-only configs.

    python -m minisgl.bench gpu decode   # bs=1 decode tok/s and memory-bandwidth utilisation
    python -m minisgl.bench gpu decode --quantization none fp8 awq   # one row per method
    python -m minisgl.bench gpu linears  # the Llama-3.1-8B linears alone: bf16 vs fp8 kernel
    python -m minisgl.bench gpu checkpoint-linears  # the same: int4 (AWQ) / block fp8 forms
    python -m minisgl.bench gpu offline  # nano-vllm's offline workload through minisgl.LLM
    python -m minisgl.bench gpu idle     # GPU idle between decode steps, overlap on vs off
    python -m minisgl.bench gpu events   # awaiting copy-done: waiter thread vs polling
    python -m minisgl.bench gpu events --device cpu  # the same hand-off, stand-in events, no GPU
    python -m minisgl.bench gpu all --json results.json

decode: `--model llama-3.1-8b --load-format dummy`; one request, decode time = time(1 + N new
tokens) - time(1 new token), plus the median GPU time of a decode step (CUDA events around
Engine.forward). Bytes per step = every weight a step reads (the input embedding table is
gathered, not read, unless it is tied to the LM head) + the KV cache read at the mean context.
MBU = bytes per step / step time / the device's peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s, ...;
`--peak-tbps` overrides).

offline: 256 requests, input and output lengths uniform in [100, 1024], random token ids,
ignore_eos, temperature 0.6 (nano-vllm's bench.py) on `qwen3-0.6b`; output tokens / wall time.

linears: each linear shape of Llama-3.1-8B at several row counts (triton.testing.do_bench:
median, L2 flushed before each run): cuBLAS on bf16 weights, and both fp8 paths (layers.fp8:
the Triton kernel, used up to its row limit; the weight widened in one pass + cuBLAS, used
above); speedup = bf16 over the path fp8 takes; GB/s = weight bytes / time.

checkpoint-linears: as linears, for the forms a quantized checkpoint loads into (layers.
gpu_blocks): int4 groups of 128 (AWQ / GPTQ / compressed-tensors) and fp8 with 128 x 128
block scales, random codes, each through the path its layer takes at that row count.

idle: CUDA events at the start and end of every Engine.forward on the engine stream. A gap is
end of step k -> start of step k+1 on the GPU; the idle fraction is the sum of gaps between
consecutive decode steps over their span. With the overlap loop the next step is queued before
the previous one ends, so gaps should be ~0; without it each gap is the host's turnaround.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from minisgl import LLM

PEAK_TBPS = [  # substring of torch.cuda.get_device_name -> HBM bandwidth, TB/s
    ("GH200", 4.0), ("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35),
    ("H800", 3.35), ("B200", 8.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935),
    ("A100", 1.555), ("L40S", 0.864), ("L40", 0.864), ("L4", 0.3), ("A10G", 0.6),
    ("RTX 4090", 1.008), ("RTX 3090", 0.936),
]


def peak_bandwidth(override_tbps: float | None) -> tuple[float, str]:
    """Bytes/s and where the number comes from."""
    if override_tbps:
        return override_tbps * 1e12, "--peak-tbps"
    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS:
        if key in name:
            return tbps * 1e12, f"table ({key})"
    props = torch.cuda.get_device_properties(0)
    clock, width = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and width:  # kHz, bits; double data rate
        return 2 * clock * 1e3 * width / 8, "device properties"
    raise SystemExit(f"unknown peak bandwidth for {name!r}: pass --peak-tbps")


class StepTimer:
    """CUDA events around each Engine.forward (they land on the engine stream)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.original = engine, engine.forward
        self.steps: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
        engine.forward = self._forward

    def _forward(self, fwd: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.original(fwd)
        end.record()
        self.steps.append((fwd.batch.phase, fwd.batch.size, start, end))
        return out

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict[str, Any]:
        torch.cuda.synchronize()
        decode = [s for s in self.steps if s[0] == "decode"]
        busy = [s[2].elapsed_time(s[3]) for s in decode]
        pairs = [(a, b) for a, b in zip(self.steps, self.steps[1:]) if a[0] == b[0] == "decode"]
        gaps = [a[3].elapsed_time(b[2]) for a, b in pairs]  # end of one -> start of the next
        span = sum(gaps) + sum(b[2].elapsed_time(b[3]) for _, b in pairs)
        return {"decode_steps": len(decode),
                "decode_step_ms": statistics.median(busy) if busy else None,
                "mean_gap_ms": statistics.mean(gaps) if gaps else None,
                "gpu_idle_fraction": sum(gaps) / span if span else None}


def weight_bytes_per_step(engine: Any) -> int:
    model = engine.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.quantized.nbytes for m in model.modules()
                 if getattr(m, "quantized", None) is not None)
    embed = model.embed_tokens.weight
    if not engine.arch.tie_word_embeddings:  # only the prompt's rows of the table are read
        total -= embed.numel() * embed.element_size()
    return total


def random_ids(rng: random.Random, n: int, vocab: int = 10000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def common_llm_args(args: argparse.Namespace, quantization: str = "none") -> dict[str, Any]:
    extra: dict[str, Any] = {"load_format": args.load_format, "device": "cuda",
                             "disable_cuda_graph": args.disable_cuda_graph,
                             "quantization": quantization}
    if args.attention_backend:
        extra["attention_backend"] = args.attention_backend
    return extra


# ---- decode ----------------------------------------------------------------------------------

def bench_decode(args: argparse.Namespace, quantization: str) -> dict[str, Any]:
    peak, peak_source = peak_bandwidth(args.peak_tbps)
    rng = random.Random(args.seed)
    prompt = random_ids(rng, args.input_len)
    ctx = args.input_len + args.output_len + 8
    with LLM(model=args.model, dtype=args.dtype, max_running_requests=4, context_length=ctx,
             **common_llm_args(args, quantization)) as llm:
        engine = llm.runtime.engine
        timer = StepTimer(engine)

        def timed(new_tokens: int) -> float:
            params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
            started = time.perf_counter()
            llm.generate(input_ids=prompt, sampling_params=params)
            return time.perf_counter() - started

        timed(8)  # warm-up: kernels, allocator, graphs
        runs = []
        for _ in range(args.repeats):
            timer.reset()
            short, long_ = timed(1), timed(1 + args.output_len)
            runs.append((long_ - short, timer.summary()["decode_step_ms"]))
        wall_s = statistics.median(r[0] for r in runs) / args.output_len
        gpu_s = statistics.median(r[1] for r in runs) / 1e3
        weights = weight_bytes_per_step(engine)
        kv = engine.kv_pool.layout.bytes_per_token(engine.kv_cache_dtype) * (
            args.input_len + args.output_len / 2)
        step_bytes = weights + kv
    return {"bench": "decode", "model": args.model, "device": torch.cuda.get_device_name(),
            "quantization": quantization, "batch_size": 1, "input_len": args.input_len,
            "output_len": args.output_len,
            "tok_s": 1 / wall_s, "step_ms": wall_s * 1e3, "gpu_step_ms": gpu_s * 1e3,
            "bytes_per_step_GB": step_bytes / 1e9, "achieved_TBps": step_bytes / wall_s / 1e12,
            "mbu": step_bytes / wall_s / peak, "mbu_gpu_time": step_bytes / gpu_s / peak,
            "peak_TBps": peak / 1e12, "peak_source": peak_source,
            "cuda_graph": not args.disable_cuda_graph}


# ---- offline (nano-vllm's workload) ----------------------------------------------------------

def nano_vllm_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(args.seed)
    prompts = [random_ids(rng, rng.randint(args.min_len, args.max_input_len))
               for _ in range(args.num_seqs)]
    params = [{"temperature": args.temperature, "ignore_eos": True,
               "max_new_tokens": rng.randint(args.min_len, args.max_output_len)}
              for _ in range(args.num_seqs)]
    return prompts, params


def fp8_kernel_max_rows(quantization: str) -> int | None:
    from minisgl.layers import fp8
    return fp8.KERNEL_MAX_ROWS if quantization == "fp8" else None


def bench_offline(args: argparse.Namespace, quantization: str) -> list[dict[str, Any]]:
    prompts, params = nano_vllm_workload(args)
    rows = []
    for overlap in (True, False) if args.compare_overlap else (True,):
        with LLM(model=args.offline_model, dtype=args.dtype,
                 disable_overlap_schedule=not overlap,
                 **common_llm_args(args, quantization)) as llm:
            llm.generate(input_ids=prompts[:1], sampling_params=params[:1])  # warm-up
            started = time.perf_counter()
            outs = llm.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - started
            tokens = sum(len(o["output_ids"]) for o in outs)
            rows.append({"bench": "offline", "model": args.offline_model,
                         "quantization": quantization, "overlap": overlap,
                         "fp8_kernel_max_rows": fp8_kernel_max_rows(quantization),
                         "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                         "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
                         "device": torch.cuda.get_device_name()})
    return rows


# ---- linears ---------------------------------------------------------------------------------

LLAMA_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                    "down": (4096, 14336)}  # (out, in)


def w8a8_scaled_mm(x: torch.Tensor, weight: Any) -> torch.Tensor:
    """For comparison only (not a minisgl path): activations quantized to float8 per token,
    cuBLAS's float8 GEMM with row-wise scales, as SGLang's fp8 runs."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 448.0
    xq = (x / scale).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, weight.codes.t(), scale_a=scale, scale_b=weight.scales[None, :],
                            out_dtype=x.dtype)


def bench_linears(args: argparse.Namespace) -> list[dict[str, Any]]:
    import triton.testing

    from minisgl.layers import fp8

    def timed(fn: Any) -> float:
        fn()  # autotuning and compilation first
        torch.cuda.synchronize()  # do_bench flushes L2 before each run, as a decode step's
        return triton.testing.do_bench(fn, return_mode="median") * 1e3  # weights arrive: us

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    kernels = fp8._kernels()
    for name, (n, k) in LLAMA_8B_LINEARS.items():
        dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)
        weight = fp8.Fp8ChannelWeight(dense)
        dequantize_us = timed(lambda: weight.widened(torch.bfloat16))
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            bf16_us = timed(lambda: torch.nn.functional.linear(x, dense))
            kernel_us = timed(lambda: kernels.fp8_matmul(x, weight.codes, weight.scales))
            widen_us = timed(lambda: torch.nn.functional.linear(x, weight.widened(x.dtype)))
            fp8_us = kernel_us if m <= fp8.KERNEL_MAX_ROWS else widen_us
            try:
                w8a8_us = timed(lambda: w8a8_scaled_mm(x, weight))
            except RuntimeError as exc:  # a torch without row-wise float8 scaling
                print(f"w8a8 comparison skipped: {exc}", file=sys.stderr)
                w8a8_us = None
            rows.append({"bench": "linears", "layer": name, "rows": m, "bf16_us": bf16_us,
                         "fp8_kernel_us": kernel_us, "fp8_widen_us": widen_us,
                         "dequantize_us": dequantize_us, "w8a8_us": w8a8_us,
                         "bf16_GBps": dense.nbytes / bf16_us / 1e3,
                         "fp8_kernel_GBps": weight.nbytes / kernel_us / 1e3,
                         "speedup": bf16_us / fp8_us,
                         "w8a8_speedup": w8a8_us and bf16_us / w8a8_us})
        del dense, weight
    return rows


def bench_checkpoint_linears(args: argparse.Namespace) -> list[dict[str, Any]]:
    import triton.testing

    from minisgl.layers import gpu_blocks
    from minisgl.layers.fp8 import Fp8ChannelWeight
    from minisgl.layers.gpu_blocks import Int4GroupWeight

    def timed(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, return_mode="median") * 1e3

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    for name, (n, k) in LLAMA_8B_LINEARS.items():
        dense = torch.randn(n, k, device="cuda", generator=gen).mul_(0.02).to(torch.bfloat16)
        int4 = Int4GroupWeight.__new__(Int4GroupWeight)
        int4.out_features, int4.in_features = n, k
        int4.words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda",
                                   dtype=torch.int32, generator=gen)
        int4.scales = torch.full((n, k // 128), 0.02 / 4.6, device="cuda", dtype=torch.float16)
        int4.zeros = torch.full((n, k // 128), 8, device="cuda", dtype=torch.uint8)
        fp8 = Fp8ChannelWeight.from_codes(
            (torch.randn(n, k, device="cuda", generator=gen) * 100).to(torch.float8_e4m3fn),
            torch.full((n, -(-k // 128)), 1e-4, device="cuda"), 128)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            bf16_us = timed(lambda: torch.nn.functional.linear(x, dense))
            int4_us = timed(lambda: int4.matmul(x))  # the layer's choice (KERNEL_MAX_ROWS)
            int4_kernel_us = timed(lambda: gpu_blocks._kernels().int4_matmul(
                x, int4.words, int4.scales, int4.zeros))
            int4_widen_us = timed(lambda: torch.nn.functional.linear(x, int4.widened(x.dtype)))
            fp8_us = timed(lambda: fp8.matmul(x))
            rows.append({"bench": "checkpoint-linears", "layer": name, "rows": m,
                         "bf16_us": bf16_us, "int4_us": int4_us, "int4_kernel_us": int4_kernel_us,
                         "int4_widen_us": int4_widen_us, "fp8_block_us": fp8_us,
                         "bf16_GBps": dense.nbytes / bf16_us / 1e3,
                         "int4_GBps": int4.nbytes / int4_us / 1e3,
                         "fp8_block_GBps": (fp8.codes.numel() + fp8.scales.numel() * 4)
                         / fp8_us / 1e3,
                         "int4_speedup": bf16_us / int4_us, "fp8_speedup": bf16_us / fp8_us})
    return rows


def bench_int4_configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each of the int4 kernel's configs alone at the Llama-3.1-8B shapes (AWQ-style groups of
    128, L2 flushed), beside the autotuner's pick: what its choice leaves behind."""
    import triton
    import triton.testing

    from minisgl.kernels import int4_matmul as kernels
    from minisgl.kernels.fp8_matmul import MAX_TUNED_ROWS

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    heuristics = kernels._int4_matmul_kernel.fn
    for name, (n, k) in LLAMA_8B_LINEARS.items():
        words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32,
                              generator=gen)
        scales = torch.full((n, k // 128), 0.005, device="cuda", dtype=torch.float16)
        zeros = torch.full((n, k // 128), 8, device="cuda", dtype=torch.uint8)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.empty((m, n), dtype=x.dtype, device="cuda")
            bucket = min(triton.next_power_of_2(m), MAX_TUNED_ROWS)
            named = {"GROUP": 128, "K": k, "M_BUCKET": bucket}
            for config in kernels._prune(kernels._configs(), named):
                meta = config.kwargs
                grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))

                def launch() -> None:
                    heuristics[grid](x, words, scales, zeros, out, m, n, k, bucket, x.stride(0),
                                     words.stride(0), scales.stride(0), out.stride(0), 128,
                                     num_warps=config.num_warps, num_stages=config.num_stages,
                                     **meta)
                launch()
                us = triton.testing.do_bench(launch, return_mode="median") * 1e3
                rows.append({"bench": "int4-configs", "layer": name, "rows": m,
                             "config": "M{BLOCK_M} N{BLOCK_N} K{BLOCK_K}".format(**meta)
                             + f" w{config.num_warps} s{config.num_stages}",
                             "us": us, "GBps": words.nbytes / us / 1e3})
            kernels.int4_matmul(x, words, scales, zeros)
            us = triton.testing.do_bench(lambda: kernels.int4_matmul(x, words, scales, zeros),
                                         return_mode="median") * 1e3
            rows.append({"bench": "int4-configs", "layer": name, "rows": m,
                         "config": f"autotuner's pick: {kernels._int4_matmul_kernel.best_config}",
                         "us": us, "GBps": words.nbytes / us / 1e3})
    return rows


# ---- idle fraction ---------------------------------------------------------------------------

def bench_idle(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    prompts = [random_ids(rng, args.idle_input_len) for _ in range(args.idle_requests)]
    params = {"max_new_tokens": args.idle_output_len, "ignore_eos": True, "temperature": 0}
    rows = []
    for overlap in (True, False):
        with LLM(model=args.offline_model, dtype=args.dtype,
                 max_running_requests=args.idle_requests, disable_overlap_schedule=not overlap,
                 **common_llm_args(args)) as llm:
            timer = StepTimer(llm.runtime.engine)
            llm.generate(input_ids=prompts[:2], sampling_params=params)  # warm-up
            timer.reset()
            started = time.perf_counter()
            if args.trace and overlap:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    outs = llm.generate(input_ids=prompts, sampling_params=params)
                prof.export_chrome_trace(str(args.trace))
            else:
                outs = llm.generate(input_ids=prompts, sampling_params=params)
            wall = time.perf_counter() - started
            tokens = sum(len(o["output_ids"]) for o in outs)
            rows.append({"bench": "idle", "model": args.offline_model, "overlap": overlap,
                         "batch": args.idle_requests, "output_tok_s": tokens / wall,
                         **timer.summary()})
    return rows


# ---- events ----------------------------------------------------------------------------------

def bench_events(args: argparse.Namespace) -> list[dict[str, Any]]:
    from minisgl.bench.event_waits import benchmark_waiters
    rows = []
    for busy in (0.0, 50.0):
        for row in benchmark_waiters(args.device, tuple(args.event_ms), args.event_iters, busy):
            rows.append({"bench": "events", **row})
    return rows


# ---- main ------------------------------------------------------------------------------------

def print_table(rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys and k not in ("bench", "device")]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        cells = []
        for key in keys:
            value = row.get(key)
            cells.append("" if value is None else f"{value:.4g}" if isinstance(value, float)
                         else str(value))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["decode", "offline", "idle", "events", "linears",
                                         "checkpoint-linears", "int4-configs", "all"])
    parser.add_argument("--model", default="llama-3.1-8b", help="decode bench model")
    parser.add_argument("--offline-model", default="qwen3-0.6b", help="offline/idle model")
    parser.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--attention-backend", choices=["torch", "flashinfer"])
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--quantization", nargs="+", default=["none"],
                        choices=["none", "fp8", "awq"],
                        help="decode / offline: one row per method (awq: random int4 groups "
                             "of 128, as an AWQ checkpoint loads)")
    parser.add_argument("--fp8-kernel-max-rows", type=int,
                        help="override layers.fp8.KERNEL_MAX_ROWS (the kernel / widen switch)")
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 160, 256, 512, 2048, 8192],
                        help="linears: row counts")
    parser.add_argument("--peak-tbps", type=float, help="device peak memory bandwidth, TB/s")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--compare-overlap", action="store_true",
                        help="offline: also run with --disable-overlap-schedule")
    parser.add_argument("--idle-requests", type=int, default=64)
    parser.add_argument("--idle-input-len", type=int, default=256)
    parser.add_argument("--idle-output-len", type=int, default=256)
    parser.add_argument("--trace", type=Path, help="idle: chrome trace of the overlap run")
    parser.add_argument("--event-ms", type=float, nargs="+", default=[0.2, 1.0, 5.0, 20.0])
    parser.add_argument("--event-iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="events only: cpu times the thread hand-off with stand-in events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not (args.what == "events" and args.device == "cpu"):
        raise SystemExit("gpu.py needs a CUDA device (only `events --device cpu` runs "
                         "without one)")

    if args.fp8_kernel_max_rows is not None:
        from minisgl.layers import fp8
        fp8.KERNEL_MAX_ROWS = args.fp8_kernel_max_rows
    rows: list[dict[str, Any]] = []
    for method in args.quantization:
        if args.what in ("decode", "all"):
            rows.append(bench_decode(args, method))
        if args.what in ("offline", "all"):
            rows += bench_offline(args, method)
    if args.what in ("linears", "all"):
        rows += bench_linears(args)
    if args.what in ("checkpoint-linears", "all"):
        rows += bench_checkpoint_linears(args)
    if args.what == "int4-configs":
        rows += bench_int4_configs(args)
    if args.what in ("idle", "all"):
        rows += bench_idle(args)
    if args.what in ("events", "all"):
        rows += bench_events(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
    print(f"\n{device or platform.machine()}, torch {torch.__version__}")
    for bench in dict.fromkeys(r["bench"] for r in rows):
        print(f"\n{bench}")
        print_table([r for r in rows if r["bench"] == bench])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Time one decode forward (model only: no scheduler, no sampler) at several batch sizes.

    python -m minisgl.bench decode-step --batch 1 8 32 64 --context 128 [--dtype bfloat16]
        [--quantization gguf|w8a8_int8|mxfp4|none] [--cpu-int8-activations] [--model PATH]
        [--json-model-override-args '{...}'] [--mamba-ssm-dtype float32|bfloat16]
        [--kv-cache-dtype auto int8 ...]   # each timed in turn, on engines built alike

The windowed attention path (BENCHMARKS.md, "Sliding windows"): the bundled weights served as
a Mistral with a window, beside the same model without one:
    python -m minisgl.bench decode-step --batch 1 8 --context 2048 --dtype float32 \
        --json-model-override-args '{"architectures": ["MistralForCausalLM"],
                                     "model_type": "mistral", "sliding_window": 256}'

Reports ms per step, tokens/s, the weight bytes read per second and the memory-bandwidth
utilisation (MBU, as gpt-fast reports it: the weights and KV a step must read / its time / the
machine's streaming read bandwidth, measured in the same run on the engine's threads,
bench.bandwidth, of a buffer of the step's weights' size read again and again: where the caches
hold that size, faster than memory; MBU (DRAM): of 1 GiB); where the layers run as one call
(models.fused_layers), the same step with their modules too.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from minisgl.bench.bandwidth import streaming_read_gbps
from minisgl.core import Batch
from minisgl.engine import Engine, EngineConfig
from minisgl.engine.memory import decode_weight_bytes


def decode_batch(engine: Engine, batch_size: int, context: int) -> tuple[Batch, torch.Tensor]:
    stride = context + 8
    for row in range(batch_size):
        engine.page_table[row, : context + 1] = torch.arange(
            row * stride, row * stride + context + 1, dtype=torch.int32)
    positions = torch.full((batch_size,), context)
    batch = Batch("decode", batch_size, table_rows=list(range(batch_size)),
                  cached_lens=[context] * batch_size, seq_lens=[context + 1] * batch_size,
                  extend_lens=[1] * batch_size, input_positions=positions,
                  out_loc=torch.arange(batch_size) * stride + context)
    engine.attn_backend.prepare_metadata(batch)
    return batch, torch.randint(100, 20000, (batch_size,))


def fill_kv_pool(engine: Engine) -> None:
    """Random values in every page: pages never written would be read from the kernel's one
    zero page (from cache, not DRAM)."""
    pool = engine.kv_pool
    for buffer in pool.buffers.values():
        for layer in buffer.view(-1, *buffer.shape[2:]):  # NOTE: one layer's temporary at a time
            if layer.dtype == torch.int8:
                layer.random_(-127, 128)
            else:
                layer.copy_(torch.randn(layer.shape) * 0.5)
    for scales in pool.scales.values():
        scales.uniform_(0.001, 0.01)


def decode_step_seconds(engine: Engine, batch_size: int, context: int, steps: int) -> float:
    """The mean time of one decode forward of `batch_size` rows at `context`, after 3 warm-up
    steps, on the engine thread as in serving (see engine.stream.CpuStream)."""
    batch, ids = decode_batch(engine, batch_size, context)

    def timed() -> float:
        with torch.inference_mode():
            for _ in range(3):
                engine.model(ids, batch.input_positions, batch, engine.attn_backend, None)
            started = time.perf_counter()
            for _ in range(steps):
                engine.model(ids, batch.input_positions, batch, engine.attn_backend, None)
        return (time.perf_counter() - started) / steps

    run = engine.stream.call if hasattr(engine.stream, "call") else (lambda fn: fn())
    return run(timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default=None,
                        choices=["gguf", "w8a8_int8", "mxfp4", "none"])
    parser.add_argument("--model", default=None, help="a model path (default: the bundled one)")
    parser.add_argument("--json-model-override-args", default=None)
    parser.add_argument("--load-format", default="auto",
                        help="dummy: random weights (a shipped shape-only config)")
    parser.add_argument("--cpu-int8-activations", action="store_true")
    parser.add_argument("--mamba-ssm-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="a hybrid's recurrent states between steps")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"],
                        help="what the KV pages hold; several: one engine each, in turn")
    args = parser.parse_args()
    for kv_cache_dtype in args.kv_cache_dtype:
        time_steps(args, kv_cache_dtype)


def time_steps(args: argparse.Namespace, kv_cache_dtype: str) -> None:
    most = max(args.batch)
    engine = Engine(EngineConfig(model_path=args.model, dtype=args.dtype,
                                 load_format=args.load_format,
                                 max_running_requests=most,
                                 quantization=args.quantization,
                                 cpu_int8_activations=args.cpu_int8_activations,
                                 mamba_ssm_dtype=args.mamba_ssm_dtype,
                                 kv_cache_dtype=kv_cache_dtype,
                                 json_model_override_args=args.json_model_override_args,
                                 max_total_tokens=most * (args.context + 8) + 16))
    read = decode_weight_bytes(engine.model)
    run = engine.stream.call if hasattr(engine.stream, "call") else (lambda fn: fn())
    # NOTE: on the engine thread: a parallel op on this one would start a second OpenMP team,
    # and with more team threads than cores libgomp sleeps at every barrier instead of spinning
    run(lambda: fill_kv_pool(engine))
    bandwidth = run(streaming_read_gbps) * 1e9
    held = run(lambda: streaming_read_gbps(mib=max(1, round(read / 2**20)))) * 1e9
    kv_per_token = engine.kv_pool.layout.bytes_per_token(engine.kv_pool.cache_dtype)
    states = getattr(engine, "states", None)
    print(f"{args.dtype}, quantization {engine.quantization}, KV pages "
          f"{engine.config.kv_cache_dtype}, context {args.context}, "
          f"weights read per step {read / 1e6:.0f} MB, "
          f"{torch.get_num_threads()} threads, streaming read {held / 1e9:.1f} GB/s of a buffer "
          f"that size ({bandwidth / 1e9:.1f} GB/s of 1 GiB: MBU (DRAM)), "
          f"peak RSS after loading "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB"
          + ("" if states is None else f", state pool {states.nbytes / 1e6:.0f} MB"))
    fused = getattr(engine.model, "fused_layers", None)
    extra = ("", "") if fused is None else (" layers as modules: step ms | fused / modules |",
                                            "---|---|")
    print(f"| batch | step ms | tok/s | weight GB/s | KV MB read | MBU | MBU (DRAM) |{extra[0]}\n"
          f"|---|---|---|---|---|---|---|{extra[1]}")
    for batch_size in args.batch:
        step = decode_step_seconds(engine, batch_size, args.context, args.steps)
        kv = batch_size * (args.context + 1) * kv_per_token
        row = f"| {batch_size} | {step * 1e3:.1f} | {batch_size / step:.0f} | " \
              f"{read / step / 1e9:.1f} | {kv / 1e6:.1f} | {(read + kv) / step / held:.0%} | " \
              f"{(read + kv) / step / bandwidth:.0%} |"
        if fused is not None:  # the same step with the layers' modules (models.fused_layers)
            engine.model.fused_layers = None
            modules = decode_step_seconds(engine, batch_size, args.context, args.steps)
            engine.model.fused_layers = fused
            row += f" {modules * 1e3:.1f} | {step / modules:.2f} |"
        print(row, flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()

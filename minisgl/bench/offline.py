"""Offline throughput through `LLM.generate`, side by side in one run.

For each concurrency: minisgl with the overlap loop, minisgl with --disable-overlap-schedule,
and (with --compare-hf) transformers `generate` in static batches of the same size, all on the
same prompts and lengths. Reports output tok/s, the engine's idle fraction of wall time, the
decode step time and the achieved weight-read bandwidth.

    python -m minisgl.bench offline --concurrency 32 64 --num-prompts 64 \
        --input-len 64 --output-len 128 --compare-hf
    python -m minisgl.bench offline --concurrency 64 --temperature 1.0 --no-overlap-baseline

Greedy by default; `--temperature` samples (top_p / top_k at their defaults), `--quantization`
picks the weight form.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from minisgl import LLM
from minisgl.engine.memory import decode_weight_bytes


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    lo, hi = args.input_len if len(args.input_len) == 2 else (args.input_len[0],) * 2
    return [[rng.randrange(100, 20000) for _ in range(rng.randint(lo, hi))]
            for _ in range(args.num_prompts)]


def output_lens(args: argparse.Namespace, count: int) -> list[int]:
    rng = random.Random(args.seed + 1)
    lo, hi = args.output_len if len(args.output_len) == 2 else (args.output_len[0],) * 2
    return [rng.randint(lo, hi) for _ in range(count)]


def run_minisgl(prompts: list[list[int]], lens: list[int], concurrency: int, overlap: bool,
                args: argparse.Namespace) -> dict:
    with LLM(args.model, dtype=args.dtype, max_running_requests=concurrency, tp_size=args.tp_size,
             disable_overlap_schedule=not overlap, max_total_tokens=args.max_total_tokens,
             quantization=args.quantization, page_size=args.page_size,
             cpu_int8_activations=args.cpu_int8_activations) as llm:
        engine = llm.runtime.engine
        params = [{"max_new_tokens": n, "ignore_eos": True, "temperature": args.temperature,
                   "top_p": 1.0, "top_k": -1} for n in lens]
        llm.generate(input_ids=prompts[:2], sampling_params=params[:2])  # warm-up
        busy0, steps0 = engine.busy_seconds, dict(engine.phase_steps)
        decode0, prefill0 = engine.phase_seconds["decode"], engine.phase_seconds["prefill"]
        started = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - started
        tokens = sum(len(o["output_ids"]) for o in outs)
        decode_steps = engine.phase_steps["decode"] - steps0["decode"]
        step = (engine.phase_seconds["decode"] - decode0) / max(decode_steps, 1)
        return {
            "system": "minisgl" + ("" if overlap else " --disable-overlap-schedule")
                      + (f" --tp-size {args.tp_size}" if args.tp_size > 1 else ""),
            "concurrency": concurrency, "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall,
            "engine_idle_fraction": 1 - (engine.busy_seconds - busy0) / wall,
            "decode_step_ms": step * 1e3, "decode_steps": decode_steps,
            "prefill_s": engine.phase_seconds["prefill"] - prefill0,
            "weight_read_GBps": (decode_weight_bytes(engine.model) / step / 1e9
                                 if decode_steps else None),
        }


def run_hf(prompts: list[list[int]], lens: list[int], batch: int, args: argparse.Namespace
           ) -> dict:
    from transformers import AutoModelForCausalLM

    from minisgl.models import resolve_model_path
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.bfloat16
                                                 if args.dtype != "float32" else torch.float32)
    model.eval()
    tokens, started = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group, new = prompts[i:i + batch], max(lens[i:i + batch])
            width = max(len(p) for p in group)
            ids = torch.tensor([[2] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=2)
            assert out.shape[1] - width == new
            tokens += sum(lens[i:i + batch])  # NOTE: the tokens asked for, as minisgl counts
    wall = time.perf_counter() - started
    return {"system": "transformers generate", "concurrency": batch, "output_tokens": tokens,
            "wall_s": wall, "output_tok_s": tokens / wall}


def arguments() -> argparse.ArgumentParser:
    """This benchmark's flags (bench.compare takes their defaults for its offline part)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs="+", default=[64],
                        help="one length, or a uniform range LOW HIGH")
    parser.add_argument("--output-len", type=int, nargs="+", default=[128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-total-tokens", type=int, default=65536)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--quantization", default=None, choices=["gguf", "w8a8_int8", "none"])
    parser.add_argument("--page-size", type=int, default=None,
                        help="KV page size (default: the engine's, 16 on CPU)")
    parser.add_argument("--cpu-int8-activations", action="store_true")
    parser.add_argument("--model", default=None, help="a model path (default: the bundled one)")
    parser.add_argument("--compare-hf", action="store_true")
    parser.add_argument("--no-overlap-baseline", dest="overlap_baseline", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser


def main() -> None:
    args = arguments().parse_args()

    prompts = make_prompts(args)
    lens = output_lens(args, len(prompts))
    rows = []
    for concurrency in args.concurrency:
        rows.append(run_minisgl(prompts, lens, concurrency, True, args))
        if args.overlap_baseline:
            rows.append(run_minisgl(prompts, lens, concurrency, False, args))
        if args.compare_hf:
            rows.append(run_hf(prompts, lens, concurrency, args))
        for row in rows[-3:]:
            print(json.dumps(row), flush=True)

    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"torch threads, torch {torch.__version__}; dtype {args.dtype}; "
          f"{args.num_prompts} prompts, input {args.input_len}, output {args.output_len}")
    print("| system | concurrency | output tok/s | engine idle | prefill | decode step | "
          "weights GB/s |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        idle = row.get("engine_idle_fraction")
        step = row.get("decode_step_ms")
        bw = row.get("weight_read_GBps")
        prefill = row.get("prefill_s")
        print(f"| {row['system']} | {row['concurrency']} | {row['output_tok_s']:.0f} | "
              f"{'' if idle is None else f'{idle:.1%}'} | "
              f"{'' if prefill is None else f'{prefill:.1f} s'} | "
              f"{'' if step is None else f'{step:.1f} ms'} | {'' if bw is None else f'{bw:.1f}'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

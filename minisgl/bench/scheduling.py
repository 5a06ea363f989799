"""Scheduling benchmarks, each side by side on fresh servers in one run.

  mixed     16 streams decode while 2,000-token prompts arrive every few seconds: inter-token
            latency of the streams (p50 / p99) and output tok/s over the same fixed work,
            default vs --enable-mixed-chunk at each of --chunk-sizes.
  priority  TTFT of urgent requests (priority 20) arriving every second or so into a server
            saturated by priority-0 requests: idle server, saturated without
            --enable-priority-scheduling, saturated with it.
  prefix    minisgl/bench/serving.py's shared-prefix workload, all requests at once:
            fcfs vs lpm (with in-batch prefix sharing): cache hit rate and tok/s.

    python -m minisgl.bench scheduling mixed priority prefix
    python -m minisgl.bench scheduling mixed --rounds 3
    python -m minisgl.bench scheduling mixed --chunk-sizes 128 256 512 1024 2048

Prints one markdown table per workload (paste into BENCHMARKS.md with the command).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from minisgl.bench import serving
from minisgl.bench.compare import ServerProcess, start_minisgl
from minisgl.server.timeline import percentile

REPO = Path(__file__).resolve().parents[2]


POOL_TOKENS = 200_000


def server_state(server: ServerProcess) -> dict[str, Any]:
    return server.info()["internal_states"][0]


def percentile_ms(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return float("nan") if value is None else value * 1e3


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def warm(url: str) -> None:
    """One-time costs (oneDNN primitives for new shapes, KV pool page faults) before timing."""
    rng = random.Random(99)
    async with session() as s:
        await asyncio.gather(*(serving.one_request(s, serving.sglang_client(url),
                                                   tokens(rng, n), 4)
                               for n in (16, 300, 2000)))


# ---- mixed ------------------------------------------------------------------------------------

async def mixed_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    stream_prompts = [[tokens(rng, args.stream_input) for _ in range(args.stream_requests)]
                      for _ in range(args.streams)]
    long_prompts = [tokens(rng, args.long_input) for _ in range(args.long_prompts)]
    cargs = serving.sglang_client(url)
    async with session() as s:
        async def stream(prompts: list[list[int]]) -> list[serving.Result]:
            return [await serving.one_request(s, cargs, p, args.stream_output)
                    for p in prompts]

        async def long_one(k: int, prompt: list[int]) -> serving.Result:
            await asyncio.sleep(args.long_first + k * args.long_every)
            return await serving.one_request(s, cargs, prompt, args.long_output)

        started = time.perf_counter()
        streams = [asyncio.create_task(stream(p)) for p in stream_prompts]
        longs = await asyncio.gather(*(long_one(k, p) for k, p in enumerate(long_prompts)))
        stream_results = [r for results in await asyncio.gather(*streams) for r in results]
        duration = time.perf_counter() - started
    everything = stream_results + longs
    assert all(r.ok for r in everything), [r.error for r in everything if not r.ok][:3]
    itl = [x for r in stream_results for x in r.itl]
    return {"itl_p50_ms": percentile_ms(itl, 0.5), "itl_p99_ms": percentile_ms(itl, 0.99),
            "itl_max_ms": max(itl) * 1e3,
            "long_ttft_ms": statistics.median(r.ttft for r in longs) * 1e3,
            "output_tok_s": sum(r.output_len for r in everything) / duration,
            "duration_s": duration}


def bench_mixed(args: argparse.Namespace) -> None:
    configs = [("default (chunk 8192, unmixed)", ("--chunked-prefill-size", "8192"))]
    configs += [(f"--enable-mixed-chunk, chunk {c}",
                 ("--enable-mixed-chunk", "--chunked-prefill-size", str(c)))
                for c in args.chunk_sizes]
    print(f"\n### mixed: {args.streams} streams x {args.stream_requests} requests "
          f"({args.stream_input} in, {args.stream_output} out) + {args.long_prompts} prompts "
          f"of {args.long_input} tokens every {args.long_every} s\n")
    print("| server | stream ITL p50 ms | p99 ms | max ms | long-prompt TTFT ms | "
          "output tok/s | mixed steps |")
    print("|---|---|---|---|---|---|---|")
    for round_, (name, flags) in ((r, c) for r in range(args.rounds) for c in configs):
        server = start_minisgl(True, args.streams + 4, POOL_TOKENS, flags)
        try:
            asyncio.run(warm(server.url))
            row = asyncio.run(mixed_load(server.url, args))
            steps = server_state(server)["engine_mixed_steps"]
        finally:
            server.stop()
        name = name if args.rounds == 1 else f"{name}, round {round_ + 1}"
        print(f"| {name} | {row['itl_p50_ms']:.0f} | {row['itl_p99_ms']:.0f} | "
              f"{row['itl_max_ms']:.0f} | {row['long_ttft_ms']:.0f} | "
              f"{row['output_tok_s']:.1f} | {steps} |", flush=True)


# ---- priority ----------------------------------------------------------------------------------

async def priority_load(url: str, args: argparse.Namespace, saturate: bool) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    background = [tokens(rng, args.input_len) for _ in range(args.background_requests)]
    probes = [tokens(rng, args.input_len) for _ in range(args.probes)]
    low = serving.sglang_client(url, "--priority", "0")
    urgent = serving.sglang_client(url, "--priority", str(args.urgent_priority))
    async with session() as s:
        semaphore = asyncio.Semaphore(args.background_concurrency)

        async def one_background(prompt: list[int]) -> serving.Result:
            async with semaphore:
                return await serving.one_request(s, low, prompt, args.output_len)

        async def probe(k: int, prompt: list[int]) -> serving.Result:
            await asyncio.sleep(args.probe_first + k * args.probe_every)
            return await serving.one_request(s, urgent, prompt, args.probe_output)

        started = time.perf_counter()
        tasks = [asyncio.create_task(one_background(p)) for p in background] if saturate else []
        probed = await asyncio.gather(*(probe(k, p) for k, p in enumerate(probes)))
        done = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    assert all(r.ok for r in probed + done)
    ttft = [r.ttft for r in probed]
    return {"ttft_median_ms": statistics.median(ttft) * 1e3, "ttft_max_ms": max(ttft) * 1e3,
            "background_tok_s": sum(r.output_len for r in done) / duration if done else None}


def bench_priority(args: argparse.Namespace) -> None:
    print(f"\n### priority: urgent requests (priority {args.urgent_priority}, {args.input_len} "
          f"in, {args.probe_output} out) every {args.probe_every} s; saturation: "
          f"{args.background_requests} priority-0 requests ({args.input_len} in, "
          f"{args.output_len} out) {args.background_concurrency} at a time, "
          f"--max-running-requests {args.max_running}\n")
    print("| server | load | urgent TTFT median ms | max ms | background tok/s | "
          "preemptions |")
    print("|---|---|---|---|---|---|")
    for name, flags, saturate in (
            ("--enable-priority-scheduling", ("--enable-priority-scheduling",), False),
            ("default", (), True),
            ("--enable-priority-scheduling", ("--enable-priority-scheduling",), True)):
        server = start_minisgl(True, args.max_running, POOL_TOKENS, flags)
        try:
            asyncio.run(warm(server.url))
            row = asyncio.run(priority_load(server.url, args, saturate))
            preemptions = server_state(server)["preemptions"]
        finally:
            server.stop()
        tok_s = "" if row["background_tok_s"] is None else f"{row['background_tok_s']:.1f}"
        print(f"| {name} | {'saturated' if saturate else 'idle'} | "
              f"{row['ttft_median_ms']:.0f} | {row['ttft_max_ms']:.0f} | {tok_s} | "
              f"{preemptions} |", flush=True)


# ---- prefix ------------------------------------------------------------------------------------

def bench_prefix(args: argparse.Namespace) -> None:
    argv = ["--backend", "sglang", "--quiet", "--ignore-eos", "--num-groups", str(args.groups),
            "--prefix-len", str(args.prefix_len), "--input-len", "64", "--output-len", "32",
            "--num-prompts", str(args.groups * args.per_group),
            "--max-concurrency", str(args.groups * args.per_group), "--seed", str(args.seed)]
    print(f"\n### prefix: serving.py {' '.join(argv)} (all at once)\n")
    print("| server | cache hit rate | input tok/s | output tok/s | TTFT median ms |")
    print("|---|---|---|---|---|")
    for policy in ("fcfs", "lpm"):
        server = start_minisgl(True, args.groups * args.per_group, POOL_TOKENS,
                               ("--schedule-policy", policy))
        try:
            asyncio.run(warm(server.url))
            before = server_state(server)
            result = asyncio.run(serving.run(serving.parse_args(
                ["--base-url", server.url, *argv])))
            after = server_state(server)
        finally:
            server.stop()
        hit = ((after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
               / (after["prompt_tokens"] - before["prompt_tokens"]))
        print(f"| --schedule-policy {policy} | {hit:.1%} | {result['input_tok_s']:.0f} | "
              f"{result['output_tok_s']:.1f} | {result['ttft_ms']['median']:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="+", choices=["mixed", "priority", "prefix"])
    parser.add_argument("--seed", type=int, default=0)
    mixed = parser.add_argument_group("mixed")
    mixed.add_argument("--chunk-sizes", type=int, nargs="+", default=[256])
    mixed.add_argument("--rounds", type=int, default=1, help="run every row this many times, "
                       "alternating (the rows are a few % apart: rounds show the noise)")
    mixed.add_argument("--streams", type=int, default=16)
    mixed.add_argument("--stream-requests", type=int, default=2)
    mixed.add_argument("--stream-input", type=int, default=64)
    mixed.add_argument("--stream-output", type=int, default=200)
    mixed.add_argument("--long-prompts", type=int, default=4)
    mixed.add_argument("--long-input", type=int, default=2000)
    mixed.add_argument("--long-output", type=int, default=8)
    mixed.add_argument("--long-first", type=float, default=1.0)
    mixed.add_argument("--long-every", type=float, default=3.0)
    prio = parser.add_argument_group("priority")
    prio.add_argument("--max-running", type=int, default=8)
    prio.add_argument("--background-requests", type=int, default=48)
    prio.add_argument("--background-concurrency", type=int, default=24)
    prio.add_argument("--input-len", type=int, default=128)
    prio.add_argument("--output-len", type=int, default=128)
    prio.add_argument("--probes", type=int, default=8)
    prio.add_argument("--probe-output", type=int, default=8)
    prio.add_argument("--probe-first", type=float, default=2.0)
    prio.add_argument("--probe-every", type=float, default=1.0)
    prio.add_argument("--urgent-priority", type=int, default=20)
    prefix = parser.add_argument_group("prefix")
    prefix.add_argument("--groups", type=int, default=8)
    prefix.add_argument("--per-group", type=int, default=8)
    prefix.add_argument("--prefix-len", type=int, default=512)
    args = parser.parse_args()
    for workload in args.workloads:
        {"mixed": bench_mixed, "priority": bench_priority, "prefix": bench_prefix}[workload](args)


if __name__ == "__main__":
    main()

"""Embedding throughput (`--is-embedding`, POST /v1/embeddings, one input per request) beside
the same model's prefill throughput (a generation server's /generate with max_new_tokens 1:
one prefill, one sampled token), on the same kind of prompts: random token ids, every prompt
distinct (no prefix-cache hits), each concurrency level on fresh prompts.

By default it starts each server in turn (`python -m minisgl serve --port 0`, the flags after
`--` added to both) and stops it before the next, so the two never share the cores; give
--embedding-url / --generation-url to measure servers already running instead.

    python -m minisgl.bench embeddings --concurrency 1 64 --num-requests 256 --input-len 128 \
        -- --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import aiohttp

REPO_ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"minisgl ready: listening on (http://\S+)")
START_TIMEOUT_S = 600.0


@dataclass
class Row:
    server: str
    endpoint: str
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    latencies: list[float]

    @property
    def inputs_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@contextlib.contextmanager
def served(extra: list[str], url: str | None) -> Iterator[str]:
    """A server's base URL: `url` as given, or a fresh server started with `extra` flags."""
    if url is not None:
        yield url.rstrip("/")
        return
    cmd = [sys.executable, "-m", "minisgl", "serve", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = READY.search(line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not ready.wait(START_TIMEOUT_S) or not found:
            raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
        yield found[0]
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def token_prompts(count: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


async def run_level(url: str, path: str, bodies: list[dict], concurrency: int
                    ) -> tuple[float, list[float]]:
    """(wall seconds, per-request latencies) of `bodies` sent with at most `concurrency` in
    flight."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(body: dict) -> None:
            async with gate:
                started = time.perf_counter()
                async with session.post(url + path, json=body) as response:
                    text = await response.text()
                    if response.status != 200:
                        raise RuntimeError(f"{path}: HTTP {response.status}: {text[:300]}")
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started, latencies


def measure_endpoint(url: str, server: str, args: argparse.Namespace, embedding: bool) -> list[Row]:
    path = "/v1/embeddings" if embedding else "/generate"
    endpoint = path if embedding else "/generate max_new_tokens=1"
    rows = []
    for level, concurrency in enumerate(args.concurrency):
        # NOTE: fresh prompts per level, the same on both servers: no prefix-cache hits
        batch = token_prompts(args.num_requests, args.input_len, args.seed + level)
        bodies = ([{"input": p, "encoding_format": "float"} for p in batch] if embedding else
                  [{"input_ids": p, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
                   for p in batch])
        warmup = token_prompts(min(concurrency, args.num_requests), args.input_len, -1 - level)
        warm = ([{"input": p} for p in warmup] if embedding else
                [{"input_ids": p, "sampling_params": {"max_new_tokens": 1}} for p in warmup])
        asyncio.run(run_level(url, path, warm, concurrency))
        seconds, latencies = asyncio.run(run_level(url, path, bodies, concurrency))
        rows.append(Row(server, endpoint, concurrency, len(bodies), seconds,
                        len(bodies) * args.input_len, latencies))
        print(f"{server} c={concurrency}: {rows[-1].inputs_per_s:.1f} inputs/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--num-requests", type=int, default=256,
                        help="requests per concurrency level (one input each)")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per input")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--embedding-url", help="a running --is-embedding server")
    parser.add_argument("--generation-url", help="a running generation server (same model)")
    parser.add_argument("server_flags", nargs="*",
                        help="after --: flags for both servers started here")
    args = parser.parse_args()
    flags = list(args.server_flags)
    rows = []
    with served([*flags, "--is-embedding"], args.embedding_url) as url:
        rows += measure_endpoint(url, "--is-embedding", args, embedding=True)
    with served(flags, args.generation_url) as url:
        rows += measure_endpoint(url, "generation", args, embedding=False)

    print(f"\n{args.num_requests} requests per row, {args.input_len} tokens each, server flags: "
          f"{' '.join(flags) or '(defaults)'}\n")
    print("| server | endpoint | concurrency | inputs/s | prompt tok/s | mean latency (s) | "
          "p99 latency (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        latencies = sorted(row.latencies)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"| {row.server} | {row.endpoint} | {row.concurrency} | {row.inputs_per_s:.1f} | "
              f"{row.tokens_per_s:.0f} | {statistics.mean(latencies):.3f} | {p99:.3f} |")


if __name__ == "__main__":
    main()

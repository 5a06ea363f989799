"""Online serving benchmark: an asyncio load generator for any server that speaks SGLang's
`/generate` or OpenAI's `/v1/completions` / `/v1/chat/completions`.

Metric definitions follow sglang.bench_serving: TTFT = first streamed token; ITL = gaps between
streamed chunks; TPOT = (latency - TTFT) / (output tokens - 1); throughputs over the wall time
from the first request sent to the last response done.

    python -m minisgl.bench serving --base-url http://127.0.0.1:30000 --backend sglang \
        --num-prompts 128 --max-concurrency 32 --input-len 128 --output-len 128 --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp

WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money").split()


@dataclass
class Result:
    ok: bool = False
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_dataset(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)

    def length(spec: list[int]) -> int:
        return spec[0] if len(spec) == 1 else rng.randint(spec[0], spec[1])

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.token_low, args.token_high) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_groups)] if args.num_groups else []
    data = []
    for i in range(args.num_prompts):
        prefix = prefixes[i % len(prefixes)] if prefixes else []
        data.append((prefix + tokens(length(args.input_len)), length(args.output_len)))
    return data


def request_body(args: argparse.Namespace, prompt: list[int], output_len: int) -> tuple[str, dict]:
    path, body = _request_body(args, prompt, output_len)
    if getattr(args, "priority", None) is not None:
        body["priority"] = args.priority
    return path, body


def _request_body(args: argparse.Namespace, prompt: list[int], output_len: int
                  ) -> tuple[str, dict]:
    if args.backend == "sglang":
        return "/generate", {"input_ids": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": output_len, "ignore_eos": args.ignore_eos,
            "temperature": args.temperature}}
    body = {"model": args.model, "max_tokens": output_len, "stream": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True  # SGLang, vLLM and llama.cpp all accept this extension
    if args.backend == "openai-chat":
        words = [WORDS[t % len(WORDS)] for t in prompt]  # one short word ~ one token
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def one_request(session: aiohttp.ClientSession, args: argparse.Namespace,
                      prompt: list[int], output_len: int) -> Result:
    path, body = request_body(args, prompt, output_len)
    result = Result(input_len=len(prompt))
    started = last = time.perf_counter()
    try:
        async with session.post(args.base_url + path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for message in sse_messages(resp):
                now = time.perf_counter()
                count = tokens_so_far(args.backend, message, result.output_len)
                if count > result.output_len:
                    if result.output_len == 0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                result.output_len = max(result.output_len, count)
        result.latency = time.perf_counter() - started
        result.ok = result.output_len > 0
    except aiohttp.ClientError as exc:
        result.error = repr(exc)
    return result


async def sse_messages(resp: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """Each server-sent event's JSON in `resp`, as it arrives ([DONE] left out)."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            # NOTE: only data lines: a line starting with ":" is an SSE comment (the
            # keep-alive llama-server sends while a request waits)
            data = b"".join(line.removeprefix(b"data:").strip()
                            for line in event.strip().splitlines()
                            if line.startswith(b"data:"))
            if data and data != b"[DONE]":
                yield json.loads(data)


def tokens_so_far(backend: str, message: dict, previous: int) -> int:
    """Cumulative output tokens: SGLang reports them in every chunk; an OpenAI stream carries
    about one token per content chunk, and the exact total in its final usage chunk."""
    if backend == "sglang":
        return message.get("meta_info", {}).get("completion_tokens", previous)
    if message.get("usage"):
        return max(previous, message["usage"].get("completion_tokens") or 0)
    for choice in message.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return previous + 1
    return previous


async def probe_health(session: aiohttp.ClientSession, url: str, stop: asyncio.Event,
                       latencies: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            async with session.get(url + "/health") as resp:
                await resp.read()
            latencies.append(time.perf_counter() - started)
        except aiohttp.ClientError:
            pass  # NOTE: a failed probe is not a latency; the run's requests still count
        await asyncio.sleep(0.05)


def summary(results: list[Result], duration: float, health: list[float]) -> dict:
    ok = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "median": None, "p99": None}
        ordered = sorted(values)
        return {"mean": statistics.fmean(values) * 1e3, "median": statistics.median(values) * 1e3,
                "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3}

    out_tokens = sum(r.output_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": sum(r.input_len for r in ok) / duration,
        "output_tok_s": out_tokens / duration,
        "ttft_ms": stats([r.ttft for r in ok]),
        "tpot_ms": stats([(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]),
        "itl_ms": stats([x for r in ok for x in r.itl]),
        "e2e_latency_ms": stats([r.latency for r in ok]),
        "health_ms": stats(health) if health else None,
    }


async def run(args: argparse.Namespace) -> dict:
    data = make_dataset(args)
    semaphore = asyncio.Semaphore(args.max_concurrency)
    rng = random.Random(args.seed + 7)
    done = 0
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    # NOTE: a fresh connection per request, as sglang.bench_serving; reusing keep-alive ones
    # races with servers that close idle connections (llama-server).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        stop, health = asyncio.Event(), []
        prober = asyncio.create_task(probe_health(session, args.base_url, stop, health)) \
            if args.probe_health else None

        async def limited(prompt: list[int], output_len: int) -> Result:
            nonlocal done
            async with semaphore:
                result = await one_request(session, args, prompt, output_len)
            done += 1
            if not args.quiet:
                print(f"\r{done}/{len(data)} requests", end="", file=sys.stderr, flush=True)
            return result

        started = time.perf_counter()
        tasks = []
        for prompt, output_len in data:
            tasks.append(asyncio.create_task(limited(prompt, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
        if prober is not None:
            stop.set()
            await prober
    if not args.quiet:
        print(file=sys.stderr)
    return summary(results, duration, health)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--backend", choices=["sglang", "openai", "openai-chat"], default="sglang")
    parser.add_argument("--model", default="",
                        help="model name for the OpenAI backends (default: the served one)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--input-len", type=int, nargs="+", default=[128],
                        help="one length or a uniform range LOW HIGH")
    parser.add_argument("--output-len", type=int, nargs="+", default=[128])
    parser.add_argument("--num-groups", type=int, default=0,
                        help="shared-prefix dataset: this many groups sharing a prefix")
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--priority", type=int, default=None,
                        help="send this `priority` with every request (SGLang's field)")
    parser.add_argument("--token-low", type=int, default=100)
    parser.add_argument("--token-high", type=int, default=20000)
    parser.add_argument("--probe-health", action="store_true",
                        help="poll /health during the run and report its latency")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--output-json", type=Path)
    return parser.parse_args(argv)


def sglang_client(url: str, *flags: str) -> argparse.Namespace:
    """Settings for a run against a minisgl server's /generate: ignore_eos, quiet, `flags`."""
    return parse_args(["--base-url", url, "--backend", "sglang", "--ignore-eos", "--quiet",
                       *flags])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print(json.dumps(result, indent=2))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

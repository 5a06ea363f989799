"""The host cost of one streamed `/generate` chunk: shaping the cumulative SGLang result from
the request's handle and encoding it as an SSE event, once per new token, as the server does.
No model runs: the handle is fed synthetic tokens and logprobs, so only that cost is timed.

    python -m minisgl.bench stream-chunk                       # this checkout
    git worktree add /tmp/baseline REV
    python -m minisgl.bench stream-chunk --baseline /tmp/baseline   # and REV, side by side

Workloads: a plain stream; output logprobs with the top 5; and prompt logprobs from position 0
of a long prompt (plus the output's), the case where a chunk carries the most entries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = {  # name: (logprob_num, logprob_start_len)
    "plain": (-1, -1),
    "output logprobs, top 5": (5, -1),
    "prompt + output logprobs, top 5": (5, 0),
}


def new_stream() -> Callable[[Any], dict[str, Any]]:
    """One stream's chunk function (handle -> result dict) in the checkout on sys.path."""
    try:
        from minisgl.protocol.native import GenerateStream
    except ImportError:  # a checkout from before the protocol package
        from minisgl.runtime.native import generate_result
        return lambda handle: generate_result(handle, None, False)
    request = SimpleNamespace(single=True, text_in_logprobs=False, prompt_ids_wanted=False)
    stream = GenerateStream(request, None)
    return lambda handle: stream.chunk(0, handle)


def measure_chunks(tokens: int, prompt_len: int, repeats: int) -> dict[str, dict[str, float]]:
    from minisgl.core import SamplingParams
    from minisgl.runtime import ReqHandle
    from minisgl.runtime.tokenizer import DecodeState
    from minisgl.server.http import encode_event

    prompt = [(7 * i) % 49152 for i in range(prompt_len)]
    results = {}
    for name, (logprob_num, start) in WORKLOADS.items():
        best_mean, best_last, best_shape = float("inf"), float("inf"), float("inf")
        for _ in range(repeats):
            params = SamplingParams(max_new_tokens=tokens)
            handle = ReqHandle("bench", prompt, DecodeState.start(prompt, params), logprob_num,
                               params, True, logprob_start_len=start)
            if start >= 0:
                handle.input_logprobs = [-1.5] * (prompt_len - 1 - start)
                handle.input_top_logprobs = [[(-1.0, 1)] * logprob_num] * (prompt_len - 1 - start)
            shape = new_stream()
            spent = last = shaping = 0.0
            for i in range(tokens):
                handle.detok.output_ids.append(i % 49152)
                handle.detok.text += " tok"
                handle.detok.visible_len = len(handle.detok.text)
                if logprob_num >= 0:
                    handle.token_logprobs.append((-0.25, i))
                    handle.top_logprobs.append([(-0.25 - j, i + j) for j in range(logprob_num)])
                started = time.perf_counter()
                result = shape(handle)
                shaped = time.perf_counter()
                encode_event(result)
                last = time.perf_counter() - started
                spent, shaping = spent + last, shaping + shaped - started
            best_mean, best_last = min(best_mean, spent / tokens), min(best_last, last)
            best_shape = min(best_shape, shaping / tokens)
        results[name] = {"mean_us": best_mean * 1e6, "last_us": best_last * 1e6,
                         "shape_us": best_shape * 1e6}
    return results


def run_in(checkout: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--json", "--tokens", str(args.tokens),
                          "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats)],
                         env=env, cwd=checkout, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="chunks in the stream")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="best of")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured right after")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure_chunks(args.tokens, args.prompt_len, args.repeats)))
        return
    this = run_in(REPO, args)
    base = run_in(args.baseline, args) if args.baseline is not None else None
    print(f"{args.tokens} chunks, prompt {args.prompt_len} tokens; per chunk, best of "
          f"{args.repeats}, microseconds: shaping the result (mean over the stream), shaping + "
          "SSE encoding (mean), the last chunk (shaping + encoding)\n")
    head = "| workload | this: shaping | chunk | last chunk |"
    if base is not None:
        head += " baseline: shaping | chunk | last chunk | baseline / this: shaping | chunk |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, r in this.items():
        row = f"| {name} | {r['shape_us']:.0f} | {r['mean_us']:.0f} | {r['last_us']:.0f} |"
        if base is not None:
            b = base[name]
            row += (f" {b['shape_us']:.0f} | {b['mean_us']:.0f} | {b['last_us']:.0f} | "
                    f"{b['shape_us'] / r['shape_us']:.2f}x | {b['mean_us'] / r['mean_us']:.2f}x |")
        print(row)


if __name__ == "__main__":
    main()

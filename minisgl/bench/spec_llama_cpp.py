"""Speculative decoding in minisgl and in llama.cpp's server, each on vs off, side by side in
one run: the grounded workload of minisgl/bench/speculation.py (chat prompts whose answers
copy a passage), one stream, greedy, through `/v1/chat/completions` of each server. Both serve
the bundled GGUF file: llama.cpp its Q4_1 blocks, minisgl `--dtype` (float32 here where
bfloat16 has no AVX-512 support). The figure to compare is each engine's on / off ratio.

    python -m minisgl.bench spec-llama-cpp [--prompts 8] [--output-len 128]
        [--llama-spec ngram-simple "ngram-simple --spec-ngram-simple-size-n 3" ...]

Each --llama-spec entry is a `--spec-type` value, optionally with more llama-server flags.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

from minisgl.bench.compare import ServerProcess, build_llama_server, start_llama, start_minisgl
from minisgl.bench.speculation import chat_prompts
from minisgl.models.weights import bundled_gguf


def chat(server: ServerProcess, text: str, output_len: int) -> int:
    """Output tokens of one greedy chat completion."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": text}],
                       "temperature": 0, "max_tokens": output_len}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.loads(resp.read())["usage"]["completion_tokens"]


def chat_tok_s(server: ServerProcess, texts: list[str], output_len: int) -> float:
    """Output tok/s over the prompts, one at a time (after one to warm up)."""
    try:
        chat(server, texts[0], 8)
        started, tokens = time.perf_counter(), 0
        for text in texts:
            tokens += chat(server, text, output_len)
        return tokens / (time.perf_counter() - started)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--llama-spec", nargs="+", default=[
        "ngram-simple", "ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8",
        "ngram-map-k"])
    args = parser.parse_args()
    texts = chat_prompts("grounded", args.prompts)
    binary, version = build_llama_server()
    rows = []
    served = ("--dtype", args.dtype)
    off = chat_tok_s(start_minisgl(True, 1, 8192, served), texts, args.output_len)
    on = chat_tok_s(start_minisgl(True, 1, 8192, (*served, "--speculative-algorithm", "NGRAM")),
             texts, args.output_len)
    rows.append(("minisgl", "NGRAM", off, on))
    if binary is None:
        print(f"llama.cpp skipped: {version}", file=sys.stderr)
    else:
        gguf = bundled_gguf()
        off = chat_tok_s(start_llama(binary, gguf, 1, 8192), texts, args.output_len)
        for spec in args.llama_spec:
            on = chat_tok_s(start_llama(binary, gguf, 1, 8192, ("--spec-type", *spec.split())), texts,
                     args.output_len)
            rows.append((f"llama.cpp ({version.strip()})", spec, off, on))
    print("| server | speculation | off tok/s | on tok/s | on / off |")
    print("|---|---|---|---|---|")
    for name, kind, off, on in rows:
        print(f"| {name} | {kind} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")


if __name__ == "__main__":
    main()

"""`--quantization gguf` vs `w8a8_int8` vs `none` vs llama.cpp's `llama-server` on the same
GGUF, side by side in one run: output tok/s and TPOT at each stream count, with the weight bytes each reads per
decode step and the bandwidth that implies (bytes / TPOT).

    python -m minisgl.bench quantization                  # 1 8 32 64 streams
    python -m minisgl.bench quantization --concurrency 1 --skip-llama-cpp
    python -m minisgl.bench quantization --methods none w8a8_int8 --concurrency 64
    git worktree add /tmp/baseline e1856bb^     # the code before --quantization gguf
    python -m minisgl.bench quantization --baseline /tmp/baseline --skip-llama-cpp

Same client (minisgl/bench/serving.py through `/v1/completions`, ignore_eos, greedy) and the
same prompts for every server; llama-server is built once by minisgl/bench/compare.py.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from minisgl.bench import compare
from minisgl.layers.embedding import INT8_MAX_ROWS
from minisgl.models.weights import bundled_gguf

REPO = Path(__file__).resolve().parents[2]


# weight bytes one decode step reads (decode_step.py; llama.cpp: the GGUF's tensors but
# the token embedding's unused rows, i.e. the file less its metadata); gguf's LM head reads its
# 8-bit copy (32 MB with its scales) instead of bfloat16 (57 MB) for up to INT8_MAX_ROWS rows;
# w8a8_int8 reads 107 MB of int8 linears and a 28 MB int8 head at every batch size
STEP_BYTES = {"none": 269e6, "gguf": 123e6, "w8a8_int8": 135e6, "llama.cpp": 98e6,
              "baseline": 269e6}
SMALL_BATCH_BYTES = {"gguf": 98e6}
LABELS = {"none": "minisgl --quantization none", "gguf": "minisgl --quantization gguf",
          "w8a8_int8": "minisgl --quantization w8a8_int8", "llama.cpp": "llama-server"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_serving_arguments(parser)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--baseline", type=Path,
                        help="a checkout of an earlier commit: its bf16 path served alongside")
    parser.add_argument("--methods", nargs="+", default=["none", "gguf", "w8a8_int8"],
                        choices=["none", "gguf", "w8a8_int8"])
    args = parser.parse_args()
    most = max(args.concurrency)
    pool = most * (args.input_len + args.output_len + 16)
    rows: dict[str, dict[int, dict]] = {}
    labels = dict(LABELS)
    for method in args.methods:
        server = compare.start_minisgl(True, most, pool, ("--quantization", method))
        try:
            for c in args.concurrency:
                compare.log(f"{server.name}: {c} streams")
                rows.setdefault(method, {})[c] = compare.bench(server, c, args)
        finally:
            server.stop()
    if args.baseline is not None:
        rev = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip() or "baseline"
        labels["baseline"] = f"minisgl bf16 at {rev}"
        server = compare.start_minisgl(True, most, pool, checkout=args.baseline)
        try:
            for c in args.concurrency:
                compare.log(f"{labels['baseline']}: {c} streams")
                rows.setdefault("baseline", {})[c] = compare.bench(server, c, args)
        finally:
            server.stop()
    llama, note = (None, "skipped") if args.skip_llama_cpp else compare.build_llama_server()
    if llama is not None:
        for c in args.concurrency:
            server = compare.start_llama(llama, bundled_gguf(), c,
                                         args.input_len + args.output_len + 16)
            try:
                compare.log(f"{server.name}: {c} streams")
                rows.setdefault("llama.cpp", {})[c] = compare.bench(server, c, args)
            finally:
                server.stop()
    print(f"\nllama.cpp: {note}; {args.input_len} in / {args.output_len} out\n")
    print("| streams | server | output tok/s | TPOT p50 ms | weights read per step | GB/s |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        for name, label in labels.items():
            result = rows.get(name, {}).get(c)
            if result is None:
                continue
            tpot = result["tpot_ms"]["median"]
            read = (SMALL_BATCH_BYTES[name] if name in SMALL_BATCH_BYTES and c <= INT8_MAX_ROWS
                    else STEP_BYTES[name])
            print(f"| {c} | {label} | {result['output_tok_s']:.0f} | {tpot:.1f} | "
                  f"{read / 1e6:.0f} MB | {read / tpot / 1e6:.1f} |")


if __name__ == "__main__":
    main()

"""Serving A/B: minisgl servers as named flag sets (and llama.cpp's `llama-server` as a peer) on
one workload, side by side in one run, rounds alternating so that a machine's drift hits every
variant alike. Each round starts each variant's server afresh and streams the same random
prompts through its `/v1/completions` (ignore_eos) at each concurrency.

    python -m minisgl.bench ab --variant default= --variant mixed=--enable-mixed-chunk
    python -m minisgl.bench ab --variant bf16= --variant fp32='--dtype float32' \\
        --concurrency 1 64 --rounds 3
    python -m minisgl.bench ab --variant minisgl= --variant llama.cpp=@llama-server
    python -m minisgl.bench ab --gguf model.Q4_K_M.gguf --variant minisgl='--quantization gguf' \
        --variant llama.cpp=@llama-server

A variant is NAME=FLAGS (flags for `python -m minisgl serve`, shell-quoted), NAME=@PATH FLAGS
(another checkout's minisgl, e.g. a `git worktree` of an older commit), or NAME=@llama-server
(built once, as `compare` does). `--gguf FILE`: the model every variant serves (minisgl's
`--model`; the bundled one by default). The table gives medians over the rounds and each variant's
ratio to the first one.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from minisgl.bench.bandwidth import gguf_bytes_per_token, streaming_read_gbps
from minisgl.bench.compare import (REPO, ServerProcess, add_serving_arguments, bench,
                                   build_llama_server, log, start_llama, start_minisgl)
from minisgl.models.weights import bundled_gguf

LLAMA_SERVER = "@llama-server"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...] = ()
    checkout: Path = REPO
    llama_server: bool = False

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, sep, rest = spec.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"a variant is NAME=FLAGS, got {spec!r}")
        words = shlex.split(rest)
        if words[:1] == [LLAMA_SERVER]:
            return cls(name, tuple(words[1:]), llama_server=True)
        if words and words[0].startswith("@"):
            return cls(name, tuple(words[1:]), checkout=Path(words[0][1:]).resolve())
        return cls(name, tuple(words))


def start(variant: Variant, concurrency: int, args: argparse.Namespace,
          llama: Path | None) -> ServerProcess:
    context = args.input_len + args.output_len + 16
    gguf = args.gguf or bundled_gguf()
    if variant.llama_server:  # NOTE: one server per concurrency: -np slots = streams
        assert llama is not None
        return start_llama(llama, gguf, concurrency, context, variant.flags)
    most = max(args.concurrency)
    model = ("--model", str(gguf.resolve())) if args.gguf else ()
    return start_minisgl(True, most, most * context, (*model, *variant.flags), variant.checkout)


def bytes_per_token(variant: Variant, server: ServerProcess, args: argparse.Namespace
                    ) -> float | None:
    """What one decode token reads at the workload's mean context: llama.cpp's from its GGUF
    file, minisgl's from its /server_info (None from a checkout that does not report it)."""
    context = args.input_len + args.output_len / 2
    if variant.llama_server:
        weights, kv = gguf_bytes_per_token(args.gguf or bundled_gguf())
        return weights + kv * context
    model = server.info()["resolved"]["model"]
    if "decode_weight_bytes" not in model:
        return None
    return model["decode_weight_bytes"] + model["kv_bytes_per_token"] * context


def run_rounds(args: argparse.Namespace) -> dict[str, dict[int, list[dict]]]:
    """Per variant and concurrency, one bench_serving summary per round (and, once per variant,
    its bytes per decode token in `args.read`)."""
    llama = None
    if any(v.llama_server for v in args.variant):
        llama, why = (args.llama_server, "") if args.llama_server else build_llama_server()
        if llama is None:
            raise SystemExit(why)
    runs: dict[str, dict[int, list[dict]]] = {v.name: {} for v in args.variant}
    for round_ in range(args.rounds):
        for variant in args.variant:
            server = None
            try:
                for c in args.concurrency:
                    if server is None or variant.llama_server:
                        if server is not None:
                            server.stop()
                        server = start(variant, c, args, llama)
                    if variant.name not in args.read:
                        args.read[variant.name] = bytes_per_token(variant, server, args)
                    log(f"round {round_ + 1}/{args.rounds}, {variant.name}: {c} streams")
                    runs[variant.name].setdefault(c, []).append(bench(server, c, args))
            finally:
                if server is not None:
                    server.stop()
    return runs


def median_of(rounds: list[dict], key: str) -> float:
    values = [r[key]["median"] if isinstance(r[key], dict) else r[key] for r in rounds]
    return statistics.median(v for v in values if v is not None)


def table(args: argparse.Namespace, runs: dict[str, dict[int, list[dict]]]) -> str:
    first = args.variant[0].name
    lines = ["| variant | streams | output tok/s | ratio | TPOT ms | TTFT ms | MBU | MBU (DRAM) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for variant in args.variant:
        for c in args.concurrency:
            rounds = runs[variant.name][c]
            tok = median_of(rounds, "output_tok_s")
            base = median_of(runs[first][c], "output_tok_s")
            tpot = median_of(rounds, "tpot_ms")
            read = args.read.get(variant.name)
            mbu = dram = ""
            if read and c == 1:
                mbu = f"{read / (tpot / 1e3) / args.held_bandwidth[variant.name]:.0%}"
                dram = f"{read / (tpot / 1e3) / args.bandwidth:.0%}"
            lines.append(f"| {variant.name} | {c} | {tok:.0f} | {tok / base:.2f}x | "
                         f"{tpot:.1f} | {median_of(rounds, 'ttft_ms'):.0f} | {mbu} | {dram} |")
    held = ", ".join(f"{name} {read / 1e6:.0f} MB: {args.held_bandwidth[name] / 1e9:.1f} GB/s"
                     for name, read in args.read.items() if read)
    return "\n".join(lines) + (
        f"\n\nMBU (one stream): the bytes a token reads at the mean context "
        f"({args.input_len + args.output_len / 2:.0f} tokens) / TPOT / the streaming read of a "
        f"buffer of that size, read again and again ({held}); MBU (DRAM): of a 1 GiB buffer, "
        f"{args.bandwidth / 1e9:.1f} GB/s, measured first (bench.bandwidth)")


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=Variant.parse, action="append", required=True,
                        help="NAME=FLAGS, NAME=@PATH FLAGS or NAME=@llama-server (repeat)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, help="use this binary instead of building")
    parser.add_argument("--gguf", type=Path, help="the GGUF file every variant serves")
    add_serving_arguments(parser)
    parser.set_defaults(concurrency=[1, 64])
    args = parser.parse_args()
    if len({v.name for v in args.variant}) != len(args.variant):
        parser.error("variant names must differ")
    args.bandwidth = streaming_read_gbps() * 1e9
    args.read = {}
    runs = run_rounds(args)
    args.held_bandwidth = {name: streaming_read_gbps(mib=max(1, round(read / 2**20))) * 1e9
                           for name, read in args.read.items() if read}
    print(table(args, runs))
    return {"gguf": str(args.gguf) if args.gguf else None,
            "variants": {v.name: {"flags": list(v.flags), "checkout": str(v.checkout),
                                  "llama_server": v.llama_server} for v in args.variant},
            "runs": runs, "bandwidth_gbps": args.bandwidth / 1e9,
            "held_bandwidth_gbps": {k: v / 1e9 for k, v in args.held_bandwidth.items()},
            "bytes_per_token": args.read}

"""Where one stream's time per token goes, in a served run: a real server streams one long
generation while Linux `perf` samples every thread of its process; each sample is put in a
part of the step (each CPU kernel, the OpenMP barriers, the Python interpreter, torch's own
ops and dispatch, the C runtime, the Linux kernel) and a thread (the event loop, which runs the
HTTP handlers, the tokenizer, the scheduler and the detokenizer; the engine thread, which runs
the forward and sampling; the OpenMP workers; others), and given as milliseconds per token.
Beside it: the client's time per token (TPOT), the engine's decode step, the machine's
streaming read bandwidth measured in the same run (bench.bandwidth) and the memory-bandwidth
utilisation (MBU: the bytes a token reads, from the server's /server_info, / TPOT /
bandwidth).

    python -m minisgl.bench step-profile [--seconds 5] [--frequency 1999] [--out DIR]
        [-- FLAGS FOR python -m minisgl serve]

perf's raw samples stay in DIR (default .bench/step-profile, out of git): `perf report -i
DIR/perf.data` browses them. Needs `perf` (linux-perf) and permission to attach to a process.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from minisgl.bench.bandwidth import streaming_read_gbps
from minisgl.bench.compare import REPO, log, start_minisgl

SAMPLE = re.compile(r"^\s*(\d+)\s+[0-9a-f]+\s+(.*) \((.*)\)$")
TEMPLATE_BITS = re.compile(r"^tile<\d+, (\d+)")
KERNELS = {  # minisgl_cpu_kernels.so's functions, by what they do in a step
    "quantize_row": "activations quantized for the linears",
    "quantize_rows": "activations quantized for the linears",
    "quantize_activations": "activations quantized for the linears",
    "run_tasks": "attention (decode_attention)",
    "decode_attention": "attention (decode_attention)",
    "rms_norm": "RMSNorm", "rotary_": "RoPE", "store_kv_": "KV store",
    "silu_and_mul": "silu(gate) * up",
}
PYTHON, OPENMP = "Python interpreter", "OpenMP: barriers (spinning or asleep) and forks"
LIBRARIES = [  # (a part of the file name, the part of the step)
    ("libgomp", OPENMP), ("libpython", PYTHON), ("python3", PYTHON),
    ("libtorch", "torch: its ops, dispatch and allocator"),
    ("libc10", "torch: its ops, dispatch and allocator"),
    ("libc.so", "C/C++ runtime (malloc, memcpy, TLS)"),
    ("libstdc++", "C/C++ runtime (malloc, memcpy, TLS)"),
    ("ld-linux", "C/C++ runtime (malloc, memcpy, TLS)"),
    ("libm.so", "C/C++ runtime (malloc, memcpy, TLS)"),
    ("libmvec", "C/C++ runtime (malloc, memcpy, TLS)"),
    ("kernel.kallsyms", "Linux kernel (syscalls, scheduling, page faults)"),
    ("uvloop", "event loop libraries (uvloop, aiohttp, orjson)"),
    ("aiohttp", "event loop libraries (uvloop, aiohttp, orjson)"),
    ("orjson", "event loop libraries (uvloop, aiohttp, orjson)"),
    ("_asyncio", "event loop libraries (uvloop, aiohttp, orjson)"),
    ("tokenizers", "tokenizers (the Rust library)"),
]
ROLES = ["event loop", "engine thread", "OpenMP workers", "other threads"]


def part_of(symbol: str, library: str) -> str:
    """The part of the step a sample of `symbol` in `library` belongs to."""
    if "minisgl_cpu_kernels" in library:
        name = symbol.removeprefix("(anonymous namespace)::")
        if "quant_matmul" in name or "block_matmul" in name or "int8_matmul" in name:
            return "linears (their kernels' parallel loops)"
        bits = TEMPLATE_BITS.match(name)
        if bits or name.startswith(("decoded_tile", "decode_span")):
            return f"linears, {bits.group(1)}-bit codes" if bits else "linears (decoded spans)"
        base = re.split(r"[<(]", name, maxsplit=1)[0]
        return KERNELS.get(base, f"kernel: {base}")
    for marker, part in LIBRARIES:
        if marker in library:
            return part
    return f"other: {Path(library).name}"


@dataclass
class Profile:
    """Samples per (thread id, part of the step), and per (symbol, library)."""

    samples: collections.Counter = field(default_factory=collections.Counter)
    symbols: collections.Counter = field(default_factory=collections.Counter)

    def add(self, tid: int, symbol: str, library: str) -> None:
        self.samples[tid, part_of(symbol, library)] += 1
        self.symbols[symbol[:90], Path(library).name] += 1

    def roles(self, pid: int) -> dict[int, str]:
        """The event loop is the process's first thread; the engine thread is the other one
        that runs Python the most; the OpenMP workers are threads that wait at its barriers."""
        tids = {tid for tid, _ in self.samples}
        engine = max((t for t in tids if t != pid), default=None,
                     key=lambda t: self.samples[t, PYTHON])
        return {t: ("event loop" if t == pid else "engine thread" if t == engine
                    else "OpenMP workers" if self.samples[t, OPENMP] else "other threads")
                for t in tids}


def read_samples(data: Path) -> Profile:
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "tid,ip,sym,dso"],
                         capture_output=True, text=True, check=True).stdout
    profile = Profile()
    for line in out.splitlines():
        match = SAMPLE.match(line)
        if match:
            profile.add(int(match.group(1)), match.group(2), match.group(3))
    return profile


class Stream(threading.Thread):
    """One streamed /generate (random prompt ids, ignore_eos), each chunk's time and token
    count kept."""

    def __init__(self, url: str, input_len: int, output_len: int) -> None:
        super().__init__(daemon=True)
        self.url, self.output_len = url, output_len
        self.prompt = [(7 * i + 11) % 20000 + 100 for i in range(input_len)]
        self.chunks: list[tuple[float, int]] = []

    def run(self) -> None:
        body = json.dumps({"input_ids": self.prompt, "stream": True,
                           "sampling_params": {"max_new_tokens": self.output_len,
                                               "temperature": 0, "ignore_eos": True}}).encode()
        request = urllib.request.Request(self.url + "/generate", body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as resp:
                for line in resp:
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        tokens = json.loads(line[5:])["meta_info"]["completion_tokens"]
                        self.chunks.append((time.perf_counter(), tokens))
        except OSError:  # the server stopped
            pass

    def tokens_between(self, start: float, end: float) -> tuple[int, float]:
        """Tokens streamed between two times, and their mean count so far."""
        inside = [n for at, n in self.chunks if start <= at <= end]
        if len(inside) < 2:
            return 0, 0.0
        return max(inside) - min(inside), (max(inside) + min(inside)) / 2


def engine_decode(info: dict) -> tuple[float, int]:
    state = info["internal_states"][0]
    return state.get("engine_decode_seconds", 0.0), state.get("engine_decode_steps", 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="perf's window")
    parser.add_argument("--frequency", type=int, default=1999, help="samples a second")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / ".bench" / "step-profile")
    parser.add_argument("--top", type=int, default=12, help="symbols listed")
    parser.add_argument("serve_flags", nargs="*", help="after --: flags for minisgl serve")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("step-profile needs Linux perf (apt-get install linux-perf)")
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = streaming_read_gbps() * 1e9
    server = start_minisgl(True, 4, 8192, tuple(args.serve_flags))
    try:
        pid, url = server.proc.pid, server.url
        Stream(url, args.input_len, 16).run()  # warm-up
        info = server.info()
        stream = Stream(url, args.input_len, 4000)
        stream.start()
        while len(stream.chunks) < 32:
            time.sleep(0.05)
        before = engine_decode(server.info())
        data = args.out / "perf.data"
        started = time.perf_counter()
        subprocess.run(["perf", "record", "-q", "-F", str(args.frequency), "-p", str(pid),
                        "-o", str(data), "--", "sleep", str(args.seconds)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ended = time.perf_counter()
        after = engine_decode(server.info())
        tokens, generated = stream.tokens_between(started, ended)
        context = args.input_len + round(generated)
    finally:  # NOTE: the stream ends with the server
        server.stop()
    if tokens == 0:
        raise SystemExit("no token was streamed inside perf's window")
    print_report(read_samples(data), pid, info, args, bandwidth, tokens, ended - started,
                 context, (after[0] - before[0]) / max(1, after[1] - before[1]))


def print_report(profile: Profile, pid: int, info: dict, args: argparse.Namespace,
                 bandwidth: float, tokens: int, window: float, context: int,
                 engine_step: float) -> None:
    model = info["resolved"]["model"]
    tpot = window / tokens
    read = model["decode_weight_bytes"] + model["kv_bytes_per_token"] * context
    per_token_ms = 1e3 / args.frequency / tokens
    print(f"model {model['path']} ({model['quantization']}, {model['dtype']}), flags "
          f"{' '.join(args.serve_flags) or '(none)'}")
    print(f"{tokens} tokens in {window:.2f} s: TPOT {tpot * 1e3:.2f} ms, engine decode step "
          f"{engine_step * 1e3:.2f} ms; reads {read / 1e6:.1f} MB a token (weights "
          f"{model['decode_weight_bytes'] / 1e6:.1f} MB, KV at a mean {context} tokens); streaming "
          f"read {bandwidth / 1e9:.1f} GB/s: MBU {read / tpot / bandwidth:.0%} "
          f"(engine step: {read / engine_step / bandwidth:.0%})")
    roles = profile.roles(pid)
    by_part: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    busy: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter(roles.values())
    totals: collections.Counter = collections.Counter()
    for (tid, part), count in profile.samples.items():
        totals[part] += count
    floor = 0.005 * sum(totals.values())
    for (tid, part), count in profile.samples.items():
        kept = part if totals[part] >= floor else "the rest (each under 0.5%)"
        by_part[kept][roles[tid]] += count
        busy[roles[tid]] += count
    print(f"\nms per token, by thread ({', '.join(f'{threads[r]} {r}' for r in ROLES)}):\n")
    print("| part of the step | " + " | ".join(ROLES) + " |")
    print("|---|" + "---|" * len(ROLES))
    for part, counts in sorted(by_part.items(), key=lambda kv: -sum(kv[1].values())):
        print(f"| {part} | " + " | ".join(f"{counts[r] * per_token_ms:.2f}" if counts[r] else ""
                                          for r in ROLES) + " |")
    print("| **on a CPU** | " + " | ".join(f"{busy[r] * per_token_ms:.2f}" for r in ROLES) + " |")
    print("| not on a CPU (waiting, asleep) | " + " | ".join(
        f"{max(0.0, threads[r] * tpot * 1e3 - busy[r] * per_token_ms):.2f}" for r in ROLES)
        + " |")
    print(f"\nthe {args.top} busiest symbols (all threads, ms per token):")
    for (symbol, library), count in profile.symbols.most_common(args.top):
        print(f"  {count * per_token_ms:6.3f}  {symbol}  ({library})")
    log(f"perf data: {args.out / 'perf.data'}")


if __name__ == "__main__":
    main()

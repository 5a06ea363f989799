"""minisgl against the peers a CPU user would pick instead, side by side in one run.

    python -m minisgl.bench compare                      # what `make bench` runs
    python -m minisgl.bench compare --concurrency 1 8 --skip-offline --no-append

Serving (same random token-id prompts, same lengths, streamed through each server's
`/v1/completions` by minisgl/bench/serving.py):
  - minisgl (overlap loop) and minisgl --disable-overlap-schedule;
  - llama.cpp `llama-server` on the same GGUF file (-np = concurrency, -t = cores), built once
    from the llama.cpp sources inside the llama-cpp-python sdist into ~/.cache/minisgl/llama.cpp
    (if it cannot be built, the table says so and the rest goes on).
Offline (minisgl/bench/offline.py): minisgl `LLM.generate` vs transformers `generate` in static
batches, bf16, on the same prompts: fixed lengths (64 in, 128 out) at batch 1 / 8 / 32, and the
nano-vllm workload scaled down (64 prompts, lengths uniform in 32-512) at 32 / 64.

Prints a ratio table and writes it, with the command and the machine, into BENCHMARKS.md's
"Peer comparison (make bench)" section as its latest run (the one before goes: git keeps it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from minisgl.bench import offline, serving
from minisgl.models.weights import bundled_gguf

REPO = Path(__file__).resolve().parents[2]


LLAMA_CACHE = Path(os.environ.get("MINISGL_LLAMA_CPP_CACHE",
                                  Path.home() / ".cache" / "minisgl" / "llama.cpp"))
READY = re.compile(r"minisgl ready: listening on (http://\S+)")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- llama.cpp -----------------------------------------------------------------------------

def build_llama_server(cache: Path = LLAMA_CACHE) -> tuple[Path | None, str]:
    """The `llama-server` binary (built on first use) and its version, or (None, why not)."""
    binary = cache / "build" / "bin" / "llama-server"
    version_file = cache / "VERSION"
    if binary.exists() and version_file.exists():
        return binary, version_file.read_text().strip()
    if not (shutil.which("cmake") and (shutil.which("c++") or shutil.which("g++"))):
        return None, "cmake and a C++ compiler are needed to build llama-server"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            log("downloading the llama-cpp-python sdist (llama.cpp sources)")
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", "llama-cpp-python", "-d", str(cache)],
                           check=True)
            sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
        sdist = sdists[-1]
        version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
        source = cache / "src"
        if not source.exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(cache / "unpack", filter="data")
            unpacked = cache / "unpack" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
            unpacked.rename(source)
            shutil.rmtree(cache / "unpack")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"building llama-server {version} (several minutes on 2 cores)")
        started = time.perf_counter()
        # NOTE: without AMX: on an AMX-capable virtual machine its matmul crashed llama-server
        # (SIGSEGV at the first batch); the AVX-512 kernels run instead
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        subprocess.run(["cmake", "-S", str(source), "-B", str(cache / "build"), *generator,
                        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", f"-DCMAKE_C_FLAGS={no_amx}",
                        f"-DCMAKE_CXX_FLAGS={no_amx}"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(cache / "build"), "--target", "llama-server",
                        "-j", str(os.cpu_count() or 2)], check=True, stdout=subprocess.DEVNULL)
        log(f"built llama-server in {time.perf_counter() - started:.0f} s")
    except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
        return None, f"llama-server could not be built: {exc}"
    version_file.write_text(f"llama-cpp-python {version} sdist\n")
    return binary, version_file.read_text().strip()


# ---- servers -------------------------------------------------------------------------------

@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    def info(self) -> dict:
        """minisgl's /get_server_info."""
        with urllib.request.urlopen(self.url + "/get_server_info", timeout=30) as resp:
            return json.load(resp)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _collect(server: ServerProcess, ready: threading.Event) -> None:
    assert server.proc.stdout is not None
    for line in server.proc.stdout:
        server.lines.append(line)
        match = READY.search(line)
        if match and not ready.is_set():
            server.url = match.group(1)
            ready.set()
    ready.set()


def start_minisgl(overlap: bool, max_running: int, max_total_tokens: int,
                  extra: tuple[str, ...] = (), checkout: Path = REPO) -> ServerProcess:
    """`checkout`: the minisgl source tree to serve (another commit's, for a baseline)."""
    cmd = [sys.executable, "-m", "minisgl", "serve", "--port", "0", "--log-level", "warning",
           "--max-running-requests", str(max_running), "--max-total-tokens",
           str(max_total_tokens), *extra]
    if not overlap:
        cmd.append("--disable-overlap-schedule")
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = ServerProcess(" ".join(["minisgl", *extra] + ([] if overlap else
                                                    ["--disable-overlap-schedule"])), proc)
    ready = threading.Event()
    threading.Thread(target=_collect, args=(server, ready), daemon=True).start()
    if not ready.wait(300) or not server.url:
        server.stop()
        raise RuntimeError("minisgl did not start:\n" + "".join(server.lines[-30:]))
    return server


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_llama(binary: Path, gguf: Path, slots: int, context_per_slot: int,
                extra: tuple[str, ...] = ()) -> ServerProcess:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * context_per_slot), "-t", str(os.cpu_count()),
           "-cb", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = ServerProcess("llama.cpp llama-server", proc, url=f"http://127.0.0.1:{port}")
    threading.Thread(target=_collect, args=(server, threading.Event()), daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError("llama-server did not start:\n" + "".join(server.lines[-30:]))


def load(server: ServerProcess, concurrency: int, prompts: int, input_len: int, output_len: int,
         seed: int, probe: bool = False) -> dict:
    """One bench_serving run against `server` through `/v1/completions`, ignore_eos."""
    argv = ["--base-url", server.url, "--backend", "openai", "--quiet", "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--input-len", str(input_len), "--output-len", str(output_len), "--seed", str(seed)]
    if probe:
        argv.append("--probe-health")
    return asyncio.run(serving.run(serving.parse_args(argv)))


def bench(server: ServerProcess, concurrency: int, args: argparse.Namespace, probe: bool = False
          ) -> dict:
    # NOTE: a few short requests first: one-time costs (oneDNN primitives for new batch
    # shapes, page faults in the KV pool) are not what the run measures
    load(server, concurrency, concurrency, args.input_len, 8, seed=999)
    # NOTE: new prompts at each concurrency (the same for every system): a server keeps its
    # prefix cache between runs, and a repeated prompt would be a cache hit
    result = load(server, concurrency,
                  max(args.min_prompts, args.prompts_per_stream * concurrency),
                  args.input_len, args.output_len, args.seed + concurrency, probe)
    if result["failed"]:
        raise RuntimeError(f"{server.name}: {result['failed']} requests failed: "
                           f"{result['errors']}")
    return result


# ---- the run -------------------------------------------------------------------------------

def baseline_name(checkout: Path) -> str:
    rev = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    return f"minisgl at {rev or checkout}"


def run_serving(args: argparse.Namespace, llama: Path | None) -> dict[str, dict[int, dict]]:
    results: dict[str, dict[int, dict]] = {}
    most = max(args.concurrency)
    pool = most * (args.input_len + args.output_len + 16)
    extra = tuple(args.server_args.split())
    runs = [(True, REPO, None)] + ([(False, REPO, None)] if args.overlap_baseline else [])
    if args.baseline is not None:  # another checkout, same workload, right after this one
        runs.append((True, args.baseline, baseline_name(args.baseline)))
    for overlap, checkout, name in runs:
        server = start_minisgl(overlap, most, pool, extra, checkout)
        if name is not None:
            server.name = name
        elif extra:  # the report finds this tree's runs by their plain names
            server.name = server.name.replace(" " + " ".join(extra), "")
        try:
            for c in args.concurrency:
                log(f"{server.name}: {c} streams")
                results.setdefault(server.name, {})[c] = bench(
                    server, c, args, probe=args.probe_health and overlap and name is None)
        finally:
            server.stop()
    if llama is not None:
        gguf = bundled_gguf()
        for c in args.concurrency:  # NOTE: one server per concurrency: -np slots = streams
            server = start_llama(llama, gguf, c, args.input_len + args.output_len + 16)
            try:
                log(f"{server.name}: {c} streams")
                results.setdefault(server.name, {})[c] = bench(server, c, args)
            finally:
                server.stop()
    return results


@dataclass
class OfflineWorkload:
    name: str
    concurrency: list[int]
    input_len: list[int]  # one length, or a uniform range LOW HIGH
    output_len: list[int]
    prompts: int  # per run; 0: twice the concurrency (at least 4)


def offline_workloads(args: argparse.Namespace) -> list[OfflineWorkload]:
    loads = []
    if args.fixed_concurrency:  # the transformers baseline: 64 in, 128 out
        loads.append(OfflineWorkload("fixed", args.fixed_concurrency, [args.fixed_input_len],
                                     [args.fixed_output_len], 0))
    if args.offline_concurrency:  # the nano-vllm workload, scaled to this CPU
        loads.append(OfflineWorkload("varied", args.offline_concurrency, args.offline_input_len,
                                     args.offline_output_len, args.offline_prompts))
    return loads


def run_offline(args: argparse.Namespace, load: OfflineWorkload) -> list[dict]:
    rows = []
    for c in load.concurrency:
        ns = offline.arguments().parse_args([])
        ns.input_len, ns.output_len = load.input_len, load.output_len
        ns.num_prompts, ns.seed = load.prompts or max(4, 2 * c), args.seed + c
        prompts = offline.make_prompts(ns)
        lens = offline.output_lens(ns, len(prompts))
        log(f"offline {load.name}, concurrency {c}, {len(prompts)} prompts")
        rows.append(offline.run_minisgl(prompts, lens, c, True, ns))
        if not args.skip_hf:
            rows.append(offline.run_hf(prompts, lens, c, ns))
    return rows


def span(lens: list[int]) -> str:
    return "-".join(map(str, lens))


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def default_precision() -> str:
    """What `--dtype auto` and the default --quantization pick on this machine."""
    import torch

    from minisgl.engine.placement import resolve_dtype
    from minisgl.engine.quantization import resolve_quantization
    cpu = torch.device("cpu")
    dtype = resolve_dtype("auto", cpu)
    method = resolve_quantization(None, None, cpu, dtype, "auto", dtype_chosen=False)
    return f"by default here {str(dtype).removeprefix('torch.')}, --quantization {method}"


SECTION = "## Peer comparison (make bench)"
LATEST_RUN = "### The latest run"


def with_latest_run(document: str, run: str) -> str:
    """BENCHMARKS.md with `run` as the first subsection of SECTION, in place of the run written
    there before (the file holds today's figures; earlier runs stay in git)."""
    if SECTION not in document:
        return document.rstrip("\n") + f"\n\n{SECTION}\n\n{run}"
    head, _, rest = document.partition(SECTION + "\n")
    intro, _, body = rest.partition("\n### ")
    body = "### " + body if body else ""
    if body.startswith(LATEST_RUN):  # NOTE: up to the next subsection or section
        ends = [i for i in (body.find("\n### ", 1), body.find("\n## ")) if i >= 0]
        body = body[min(ends) + 1:] if ends else ""
    return f"{head}{SECTION}\n{intro.rstrip()}\n\n{run.rstrip()}\n\n{body}"


def peer_report(args: argparse.Namespace, serving: dict[str, dict[int, dict]],
           offline: list[tuple[OfflineWorkload, list[dict]]],
           llama_note: str, command: str) -> str:
    import torch
    lines = [f"{LATEST_RUN} (measured {date.today().isoformat()})", "",
             f"`{command}`", "",
             f"Machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{torch.get_num_threads()} torch threads. minisgl serves SmolLM2-135M-Instruct "
             f"with {args.server_args or 'its default flags'} ({default_precision()}); "
             f"llama.cpp: {llama_note}, on the bundled Q4_1 GGUF (98 MB per step).", ""]
    if serving:
        ours = serving.get("minisgl", {})
        off = serving.get("minisgl --disable-overlap-schedule", {})
        peer = serving.get("llama.cpp llama-server", {})
        lines += [f"Serving: {args.input_len} input / {args.output_len} output tokens, "
                  f"ignore_eos, greedy, {args.prompts_per_stream} prompts per stream, all sent "
                  "at once, streamed through `/v1/completions`.", "",
                  "| streams | minisgl tok/s | TPOT p50 | TTFT p50 | overlap off tok/s | "
                  "llama.cpp tok/s | llama.cpp TPOT p50 | TTFT p50 | minisgl / llama.cpp | "
                  "overlap on / off |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in args.concurrency:
            a, b, p = ours.get(c), off.get(c), peer.get(c)

            def tok(r: dict | None) -> str:
                return f"{r['output_tok_s']:.0f}" if r else "n/a"

            def ms(r: dict | None, key: str) -> str:
                return f"{r[key]['median']:.1f} ms" if r else "n/a"

            lines.append(
                f"| {c} | {tok(a)} | {ms(a, 'tpot_ms')} | {ms(a, 'ttft_ms')} | {tok(b)} | "
                f"{tok(p)} | {ms(p, 'tpot_ms')} | {ms(p, 'ttft_ms')} | "
                f"{ratio(a and a['output_tok_s'], p and p['output_tok_s'])} | "
                f"{ratio(a and a['output_tok_s'], b and b['output_tok_s'])} |")
        if args.baseline is not None:
            base = serving.get(baseline_name(args.baseline), {})
            lines += ["", f"Beside {baseline_name(args.baseline)} (`--baseline`), served next:",
                      "", "| streams | this tok/s | TPOT p50 | baseline tok/s | TPOT p50 | "
                      "this / baseline |", "|---|---|---|---|---|---|"]
            for c in args.concurrency:
                a, b = ours.get(c), base.get(c)
                lines.append(f"| {c} | {a['output_tok_s']:.0f} | {a['tpot_ms']['median']:.1f} ms"
                             f" | {b['output_tok_s']:.0f} | {b['tpot_ms']['median']:.1f} ms | "
                             f"{ratio(a['output_tok_s'], b['output_tok_s'])} |")
        health = [(c, r["health_ms"]) for c, r in ours.items() if r.get("health_ms")]
        if health:
            lines += ["", "minisgl `/health` while serving: " + "; ".join(
                f"{c} streams p50 {h['median']:.1f} / p99 {h['p99']:.1f} ms" for c, h in health)]
        lines.append("")
    for load, rows in offline:
        count = f"{load.prompts} prompts" if load.prompts else "2 prompts per slot (at least 4)"
        lines += [f"Offline, {load.name} lengths: {count}, input {span(load.input_len)}, output "
                  f"{span(load.output_len)} tokens{' (uniform)' if len(load.input_len) > 1 else ''}"
                  ", ignore_eos, greedy; transformers runs static batches of the same size, "
                  "bf16 (tokens counted: the ones asked for).", "",
                  "| concurrency | minisgl tok/s | engine idle | decode step | transformers tok/s "
                  "| minisgl / transformers |", "|---|---|---|---|---|---|"]
        for c in load.concurrency:
            ours = next(r for r in rows if r["system"] == "minisgl" and r["concurrency"] == c)
            hf = next((r for r in rows if r["system"] == "transformers generate"
                       and r["concurrency"] == c), None)
            hf_tok = hf["output_tok_s"] if hf else None
            lines.append(f"| {c} | {ours['output_tok_s']:.0f} | "
                         f"{ours['engine_idle_fraction']:.1%} | {ours['decode_step_ms']:.1f} ms | "
                         f"{'n/a' if hf_tok is None else f'{hf_tok:.0f}'} | "
                         f"{ratio(ours['output_tok_s'], hf_tok)} |")
        lines.append("")
    return "\n".join(lines)


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving workload `bench` runs (also minisgl/bench/quantization.py's)."""
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=2)
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serving_arguments(parser)
    parser.add_argument("--fixed-concurrency", type=int, nargs="*", default=[1, 8, 32],
                        help="offline, fixed lengths (none: skip)")
    parser.add_argument("--fixed-input-len", type=int, default=64)
    parser.add_argument("--fixed-output-len", type=int, default=128)
    parser.add_argument("--offline-concurrency", type=int, nargs="*", default=[32, 64],
                        help="offline, varied lengths (none: skip)")
    parser.add_argument("--offline-prompts", type=int, default=64)
    parser.add_argument("--offline-input-len", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--offline-output-len", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--no-overlap-baseline", dest="overlap_baseline", action="store_false")
    parser.add_argument("--no-probe-health", dest="probe_health", action="store_false")
    parser.add_argument("--llama-server", type=Path, help="use this binary instead of building")
    parser.add_argument("--baseline", type=Path,
                        help="another minisgl checkout (git worktree add /tmp/baseline REV) "
                        "served with the same workload right after this one")
    parser.add_argument("--server-args", default="",
                        help="extra flags for every minisgl server, e.g. '--dtype float32'")
    parser.add_argument("--append", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-append", dest="append", action="store_const", const=None)
    args = parser.parse_args()
    command = "python -m minisgl.bench compare " + " ".join(sys.argv[1:])

    llama = None
    llama_note = "not run (" + ("--skip-serving" if args.skip_serving else "--skip-llama-cpp") + ")"
    if not args.skip_serving and not args.skip_llama_cpp:
        if args.llama_server is not None:
            llama, llama_note = args.llama_server, f"`{args.llama_server}`"
        else:
            llama, llama_note = build_llama_server()
            if llama is None:
                log(llama_note)
    serving = {} if args.skip_serving else run_serving(args, llama)
    offline = [] if args.skip_offline else [(load, run_offline(args, load))
                                            for load in offline_workloads(args)]
    text = peer_report(args, serving, offline, llama_note, command.strip())
    print(text)
    if args.append is not None:
        args.append.write_text(with_latest_run(args.append.read_text(), text))
        log(f"written to {args.append}, section {SECTION!r}")


if __name__ == "__main__":
    main()

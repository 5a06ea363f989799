"""The hierarchical cache on a multi-turn workload whose prefixes outgrow the KV pool: SGLang's
own `bench_serving` (its generated-shared-prefix dataset, made offline: groups of prompts
sharing a long system prompt, sent shuffled) against a minisgl server without and with
`--enable-hierarchical-cache` (a disk tier, `--hicache-storage-backend file`; or a host-memory
tier, `--hicache-size`), side by side, rounds alternating. Each round starts each server afresh
(the disk tier in a round's empty folder, so every tier begins cold; `warm` starts on what
`disk` left there, as after a restart). The ratio is the first variant's median TTFT over each
one's.

    python -m minisgl.bench hicache                 # 32 groups x 1024 tokens, an 8192-token pool
    python -m minisgl.bench hicache --groups 16 --system-len 2048 --rounds 3
    python -m minisgl.bench hicache --variants off disk host warm

The working set is groups x system-len tokens; the table gives it as a multiple of the pool.
`--client`: the Python of a virtualenv with sglang's client (`make test` builds .venv-sglang).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import requests

from minisgl.bench.compare import REPO, log, start_minisgl

CLIENT = REPO / ".venv-sglang" / "bin" / "python"


def run_client(args: argparse.Namespace, url: str, out: Path) -> dict:
    tokenizer = requests.get(f"{url}/get_model_info", timeout=30).json()["tokenizer_path"]
    cmd = [str(args.client), "-m", "sglang.bench_serving", "--backend", "sglang",
           "--base-url", url, "--tokenizer", tokenizer,
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
           "--gsp-prompts-per-group", str(args.prompts_per_group),
           "--gsp-system-prompt-len", str(args.system_len),
           "--gsp-question-len", str(args.question_len), "--gsp-output-len",
           str(args.output_len), "--gsp-num-turns", str(args.turns),
           "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
           "--cache-report", "--output-file", str(out), "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    if done.returncode:
        raise RuntimeError(f"bench_serving failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text().splitlines()[-1])


VARIANTS = {
    "off": (),
    "disk": ("--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-dir", "{folder}"),
    "host": ("--enable-hierarchical-cache", "--hicache-size", "{host_gb}"),
}
VARIANTS["warm"] = VARIANTS["disk"]  # the disk variant's folder again: a restarted server


def tier_counters(url: str) -> dict[str, float]:
    """The server's hierarchical-cache counters (/metrics)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    found = dict(re.findall(r"^minisgl_hicache_(\w+)_total\{[^}]*\} (\S+)$", text, re.M))
    return {name: float(value) for name, value in found.items()}


def one_run(args: argparse.Namespace, variant: str, folder: Path) -> dict:
    flags = tuple(flag.format(folder=folder / "tiers", host_gb=args.host_gb)
                  for flag in VARIANTS[variant])
    server = start_minisgl(True, args.concurrency, args.pool_tokens,
                           ("--page-size", str(args.page_size), *args.flags, *flags))
    try:
        result = run_client(args, server.url, folder / f"{variant}.jsonl")
        tiers = tier_counters(server.url)
    finally:
        server.stop()
    report = result["cache_report"]
    read_back = tiers.get("host_hit_tokens", 0) + tiers.get("disk_hit_tokens", 0)
    return {"median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
            "mean_ttft_ms": result["mean_ttft_ms"], "duration_s": result["duration"],
            "cached_share": report["total_cached_tokens"] / report["total_prompt_tokens"],
            "tier_share": read_back / report["total_prompt_tokens"],
            "read_ms_per_1k": (1e6 * tiers.get("load_seconds", 0) / read_back
                               if read_back else 0.0),
            "saved_mb": tiers.get("saved_bytes", 0) / 1e6, "completed": result["completed"]}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--prompts-per-group", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--turns", type=int, default=1,
                        help="bench_serving's --gsp-num-turns (each turn a request)")
    parser.add_argument("--pool-tokens", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=["off", "disk"],
                        choices=list(VARIANTS), help="off, disk (the file backend), host "
                        "(a host-memory tier of --host-gb GB, no disk), warm (after disk: a "
                        "server started on the files disk left)")
    parser.add_argument("--host-gb", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--flags", nargs="*", default=[],
                        help="more `minisgl serve` flags for both servers")
    parser.add_argument("--client", type=Path, default=CLIENT)
    args = parser.parse_args()
    if not args.client.exists():
        raise SystemExit(f"no sglang client at {args.client}: `make test` builds .venv-sglang")
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    if "warm" in runs and list(runs).index("warm") < list(runs).index("disk"):
        raise SystemExit("--variants: warm reads what disk wrote, so it comes after disk")
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="minisgl-hicache-") as folder:
            for name in runs:
                log(f"round {round_ + 1}: {name}")
                runs[name].append(one_run(args, name, Path(folder)))
                log(json.dumps(runs[name][-1]))
    working = args.groups * args.system_len / args.pool_tokens
    print(f"\n{args.groups} groups x {args.prompts_per_group} prompts, system prompt "
          f"{args.system_len} + question {args.question_len} tokens, {args.output_len} out, "
          f"{args.concurrency} streams; working set {working:.1f}x the "
          f"{args.pool_tokens}-token pool; medians over {args.rounds} round(s)\n")
    first = args.variants[0]
    print("| variant | median TTFT ms | ratio | p99 TTFT ms | cached share | read back from "
          "the tier | tier read ms per 1k tokens | MB saved | duration s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    medians = {}
    for name, rounds in runs.items():
        medians[name] = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    for name, m in medians.items():
        ratio = medians[first]["median_ttft_ms"] / max(m["median_ttft_ms"], 1e-9)
        print(f"| {name} | {m['median_ttft_ms']:.0f} | {ratio:.2f}x | {m['p99_ttft_ms']:.0f} | "
              f"{m['cached_share']:.1%} | {m['tier_share']:.1%} | {m['read_ms_per_1k']:.1f} | "
              f"{m['saved_mb']:.0f} | {m['duration_s']:.1f} |")
    return {"runs": runs, "medians": medians}


if __name__ == "__main__":
    main()

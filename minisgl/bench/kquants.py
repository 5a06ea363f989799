"""The bundled model re-quantized to Q4_K_M by llama.cpp's own `llama-quantize`, served by
minisgl (`--quantization gguf`: its blocks as in the file; `gguf-int8`: the same with
--cpu-int8-activations; and `none`: dequantized) and by llama.cpp's `llama-server` from the
same file, side by side in one run: output tok/s and TPOT at each stream count, with each server
process's resident memory (peak) beside the file size and the KV pool it was given.

    python -m minisgl.bench kquants                    # 1 and 64 streams
    python -m minisgl.bench kquants --concurrency 1 8 --methods gguf
    python -m minisgl.bench kquants --methods gguf gguf-int8   # --cpu-int8-activations too
    python -m minisgl.bench kquants --methods gguf --baseline <a worktree of another commit>
    python -m minisgl.bench kquants --quality --methods gguf gguf-int8   # no servers

`--quality`: each method's prefill logits over tests/data's text (twice: 294 tokens) against
the same file dequantized in float32 (relative error, perplexity, greedy agreement), instead of the
servers.

llama-server and llama-quantize are built once from the llama-cpp-python sdist's sources
(minisgl/bench/compare.py); the Q4_K_M file is made once into the cache folder (requantized from
the bundled Q4_1, `--allow-requantize`: the weights both servers read are the same bytes).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from minisgl.bench import compare
from minisgl.models.weights import bundled_gguf, load_config, resolve_model_path

REPO = Path(__file__).resolve().parents[2]


# --methods: minisgl's flags for each
METHOD_FLAGS = {"gguf": ("--quantization", "gguf"), "none": ("--quantization", "none"),
                "gguf-int8": ("--quantization", "gguf", "--cpu-int8-activations")}


def q4_k_m_file() -> Path:
    target = compare.LLAMA_CACHE / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if target.exists():
        return target
    server, note = compare.build_llama_server()
    if server is None:
        raise SystemExit(note)
    build = compare.LLAMA_CACHE / "build"
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-quantize"], check=True,
                   stdout=subprocess.DEVNULL)
    partial = target.with_suffix(".partial")
    subprocess.run([str(build / "bin" / "llama-quantize"), "--allow-requantize",
                    str(bundled_gguf()), str(partial), "Q4_K_M"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial.rename(target)
    return target


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def kv_pool_mb(model: Path, tokens: int, bytes_per_value: int) -> float:
    config = load_config(resolve_model_path(str(model)))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
    return tokens * per_token * bytes_per_value / 1e6


def quality(model: Path, methods: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    from minisgl.engine import Engine, EngineConfig
    from tests.engine_probe import prefill_logits
    from tests.reference import prompt_ids
    from tests.test_quantization import TEXT, perplexity, relative_error

    ids = prompt_ids(TEXT + "\n\n" + TEXT)
    configs = {"float32": dict(dtype="float32", quantization="none"),
               "gguf": dict(dtype="bfloat16", quantization="gguf"),
               "gguf-int8": dict(dtype="bfloat16", quantization="gguf",
                                 cpu_int8_activations=True),
               "none": dict(dtype="bfloat16", quantization="none")}
    logits = {}
    for name in ["float32", *methods]:
        engine = Engine(EngineConfig(model_path=str(model), max_total_tokens=4096,
                                     max_running_requests=4, **configs[name]))
        logits[name] = prefill_logits(engine, ids)
        engine.shutdown()
    reference = logits["float32"]
    print(f"\n{model.name}, {len(ids)} tokens, against itself dequantized in float32\n")
    print("| method | perplexity | logits' relative error | greedy agreement |")
    print("|---|---|---|---|")
    for name, ours in logits.items():
        agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
        print(f"| {name} | {perplexity(ours, ids):.4f} | {relative_error(ours, reference):.4f} "
              f"| {agree:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_serving_arguments(parser)
    parser.set_defaults(concurrency=[1, 64])
    parser.add_argument("--methods", nargs="+", default=["gguf", "none"],
                        choices=list(METHOD_FLAGS))
    parser.add_argument("--dtype", default="auto", help="minisgl's --dtype")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of minisgl (a worktree), served after this one")
    parser.add_argument("--quality", action="store_true",
                        help="logits against the dequantized float32 model, no servers")
    args = parser.parse_args()
    model = q4_k_m_file()
    if args.quality:
        return quality(model, args.methods)
    most = max(args.concurrency)
    per_stream = args.input_len + args.output_len + 16
    rows: dict[str, dict[int, dict]] = {}
    memory: dict[str, str] = {}
    checkouts = [(compare.REPO, "")] + ([(args.baseline, " (baseline)")] if args.baseline else [])
    for method in args.methods:
        for checkout, tag in checkouts:
            server = compare.start_minisgl(True, most, most * per_stream,
                                           ("--model", str(model), *METHOD_FLAGS[method],
                                            "--dtype", args.dtype), checkout=checkout)
            try:
                for c in args.concurrency:
                    compare.log(f"minisgl {method}{tag}: {c} streams")
                    rows.setdefault(method + tag, {})[c] = compare.bench(server, c, args)
                memory[method + tag] = f"{peak_rss_mb(server.proc.pid):.0f} MB"
            finally:
                server.stop()
    binary, note = (None, "skipped") if args.skip_llama_cpp else compare.build_llama_server()
    if binary is not None:
        rss = []
        for c in args.concurrency:
            server = compare.start_llama(binary, model, c, per_stream)
            try:
                compare.log(f"llama-server: {c} streams")
                rows.setdefault("llama.cpp", {})[c] = compare.bench(server, c, args)
                rss.append(f"{peak_rss_mb(server.proc.pid):.0f} MB at {c}")
            finally:
                server.stop()
        memory["llama.cpp"] = ", ".join(rss)
    size = model.stat().st_size / 1e6
    print(f"\n{model.name}: {size:.0f} MB; llama.cpp: {note}; {args.input_len} in / "
          f"{args.output_len} out; minisgl --dtype {args.dtype}\n")
    print("| streams | server | output tok/s | TPOT p50 ms |")
    print("|---|---|---|---|")
    for c in args.concurrency:
        for name, result in ((n, r.get(c)) for n, r in rows.items()):
            if result is not None:
                label = "llama-server" if name == "llama.cpp" else f"minisgl {name}"
                print(f"| {c} | {label} | {result['output_tok_s']:.0f} | "
                      f"{result['tpot_ms']['median']:.1f} |")
    tokens = most * per_stream
    print(f"\npeak resident memory: {memory}; the KV pool for {tokens} tokens: "
          f"{kv_pool_mb(model, tokens, 4):.0f} MB in float32, {kv_pool_mb(model, tokens, 2):.0f} "
          f"MB in 16 bits (llama.cpp's f16 cache holds {args.concurrency} streams' worth)")


if __name__ == "__main__":
    main()

"""The benchmark tool: `python -m minisgl.bench NAME [ARGS]` (`python -m minisgl.bench` lists
them). Every figure in BENCHMARKS.md comes from one of these subcommands, each measuring its
variants side by side in one run; `--json PATH` before NAME writes what it measured, with the
command, the commit and the machine, as JSON. The modules here sit above the whole package:
nothing in minisgl imports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    name: str  # as typed: dashes
    module: str  # minisgl.bench.<module>
    kind: str  # serving | offline | kernel | gpu
    summary: str


SUBCOMMANDS = [
    Subcommand("compare", "compare", "serving",
               "minisgl vs llama-server vs transformers (make bench; writes BENCHMARKS.md)"),
    Subcommand("ab", "ab", "serving",
               "servers as named flag sets (and llama-server) on one workload, rounds alternating"),
    Subcommand("serving", "serving", "serving",
               "the load generator alone, against any running server"),
    Subcommand("scheduling", "scheduling", "serving",
               "mixed chunks, priorities and prefix sharing on fresh servers"),
    Subcommand("quantization", "quantization", "serving",
               "weight forms (gguf, w8a8_int8, none) and llama-server, per stream count"),
    Subcommand("kquants", "kquants", "serving",
               "a Q4_K_M file served by minisgl and by llama-server"),
    Subcommand("speculation", "speculation", "serving",
               "speculative decoding (NGRAM, STANDALONE) on vs off"),
    Subcommand("spec-llama-cpp", "spec_llama_cpp", "serving",
               "speculation in minisgl and in llama-server, each on vs off"),
    Subcommand("images", "images", "serving",
               "one image's first-token time and encoder, minisgl vs llama-server --mmproj"),
    Subcommand("embeddings", "embeddings", "serving",
               "embedding throughput beside the same model's prefill"),
    Subcommand("dashboard", "dashboard", "serving",
               "throughput and /health latency with the dashboard closed and open"),
    Subcommand("soak", "soak", "serving",
               "every feature at once, the KV pool full, for an hour: leaks, errors, end state"),
    Subcommand("hicache", "hicache", "serving",
               "the hierarchical cache off and on, a working set past the pool (SGLang's client)"),
    Subcommand("offline", "offline", "offline",
               "LLM.generate throughput, overlap loop on vs off"),
    Subcommand("lora", "lora", "offline", "multi-LoRA throughput, 0 / 1 / 8 adapters"),
    Subcommand("grammar", "grammar", "offline", "what grammar-constrained decoding costs"),
    Subcommand("json-whitespace", "json_whitespace", "offline",
               "JSON schemas with and without free whitespace"),
    Subcommand("decode-step", "decode_step", "kernel", "one decode forward, model only"),
    Subcommand("linears", "linears", "kernel", "the linear layers alone, per weight form"),
    Subcommand("attention", "attention", "kernel", "the CPU attention kernel against SDPA"),
    Subcommand("step-profile", "step_profile", "serving",
               "one served stream's time per token by part of the step and thread (perf)"),
    Subcommand("bandwidth", "bandwidth", "kernel",
               "the machine's streaming read bandwidth (what MBU divides by)"),
    Subcommand("moe", "moe", "kernel",
               "a mixture-of-experts step against the dense model of equal active size"),
    Subcommand("hybrid", "hybrid", "kernel",
               "a hybrid's decode step against the dense model of equal size; the delta rule"),
    Subcommand("hybrid-prefix", "hybrid_prefix", "offline",
               "a hybrid's first token cold, after a full prefix hit and a next turn"),
    Subcommand("stream-chunk", "stream_chunk", "kernel",
               "the host cost of one streamed /generate chunk"),
    Subcommand("load-memory", "load_memory", "kernel",
               "peak resident memory while a quantized checkpoint loads"),
    Subcommand("gpu", "gpu", "gpu", "decode, linears, offline, idle and event waits on CUDA"),
    Subcommand("gpu-profile", "gpu_profile", "gpu", "a CUDA decode step's kernels"),
]


def find(name: str) -> Subcommand | None:
    wanted = name.replace("_", "-")
    return next((s for s in SUBCOMMANDS if s.name == wanted), None)

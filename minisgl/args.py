"""Every knob of an engine or server, with SGLang's flag names, and its command-line parser."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from minisgl.flag_checks import (check_hierarchical_cache, check_lora, check_parsers,
                                 check_speculation, lora_adapters)

T = TypeVar("T")

# Flags whose default (None in ServerArgs) depends on the device the engine runs on.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "max_running_requests": {"cuda": 256, "cpu": 128},
    "mem_fraction_static": {"cuda": 0.85, "cpu": 0.25},
    "page_size": {"cuda": 1, "cpu": 16},
    "speculative_num_draft_tokens": {"cuda": 8, "cpu": 6},
}
# --chunked-prefill-size's default; on CPU the engine may pick a smaller one (see
# engine.chunking), with --enable-mixed-chunk CPU_MIXED_CHUNK.
DEFAULT_CHUNK = 8192
CPU_MIXED_CHUNK = 256


def device_default(name: str, device_type: str) -> Any:
    """The default of flag `name` (a key of DEVICE_DEFAULTS) on a `device_type` device."""
    return DEVICE_DEFAULTS[name]["cuda" if device_type == "cuda" else "cpu"]


def _flag(default: Any, help: str, *aliases: str, choices: list[str] | None = None,
          nargs: str | None = None) -> Any:
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices,
                                            "nargs": nargs})


def _is_file(value: str) -> bool:
    """Whether a flag's value names a file (an inline template may be too long for a path)."""
    try:
        return Path(value).is_file()
    except OSError:
        return False


@dataclass
class ServerArgs:
    model_path: str | None = _flag(
        None, "Hugging Face model folder, .gguf file or shipped config name "
        "(default: the bundled SmolLM2-135M-Instruct).", "--model")
    tokenizer_path: str | None = _flag(None, "Tokenizer folder (default: the model's).")
    chat_template: str | None = _flag(
        None, "Chat template for /v1/chat/completions: a file, or an inline Jinja template "
        "(default: the tokenizer's).")
    grammar_backend: str = _flag(
        "xgrammar", "Backend of json_schema / regex / ebnf / response_format constraints: "
        "xgrammar, or none (such requests get 400).", choices=["xgrammar", "none"])
    constrained_json_disable_any_whitespace: bool = _flag(
        False, "JSON schemas (json_schema, response_format, tool calls) allow one-line JSON "
        "only, json.dumps's form ({\"a\": 1, \"b\": 2}); by default the model may put any "
        "whitespace between tokens, as in SGLang.")
    tool_call_parser: str = _flag(
        "hermes", "How tool calls are read from a chat answer under tool_choice auto: hermes "
        "or qwen25 (<tool_call>{...}</tool_call>, Qwen2.5/3 style), llama3 (a JSON object), "
        "mistral ([TOOL_CALLS] and a JSON array of calls) or pythonic (a Python list of calls, "
        "[f(a=1), g(b=\"x\")]) or gemma4 (Gemma 4's <|tool_call>call:f{a:1}<tool_call|>) or "
        "gpt-oss (harmony's commentary channel; with the reasoning parser gpt-oss, the default "
        "for gpt-oss models).",
        choices=["hermes", "qwen25", "llama3", "mistral", "pythonic", "gemma4", "gpt-oss"])
    reasoning_parser: str | None = _flag(
        None, "Return a chat answer's thinking (<think>...</think>) as reasoning_content apart "
        "from content: qwen3 (Qwen3's templates, enable_thinking) or deepseek-r1 (the answer "
        "always starts inside the thinking); gemma4 (Gemma 4's <|channel>thought ... "
        "<channel|>); gpt-oss: harmony's analysis channel (with the tool-call parser gpt-oss, "
        "the default for gpt-oss models).",
        choices=["qwen3", "deepseek-r1", "gemma4", "gpt-oss"])
    sampling_defaults: str = _flag(
        "model", "model: chat requests that leave temperature, top_p, top_k, min_p or "
        "repetition_penalty out take them from the model's generation_config.json; openai: "
        "OpenAI's defaults.", choices=["model", "openai"])
    json_model_override_args: str | None = _flag(
        None, 'JSON object merged into the model config, e.g. \'{"num_hidden_layers": 2}\'.')
    load_format: str = _flag("auto", "auto: read the weights; dummy: random weights from the "
                             "config alone (benchmarks).", choices=["auto", "dummy"])
    dtype: str = _flag("auto", "auto (bfloat16; float32 on a CPU without native bfloat16 "
                       "matmuls), bfloat16, float16 or float32.",
                       choices=["auto", "bfloat16", "float16", "float32"])
    device: str = _flag("auto", "auto (cuda when available, else cpu), cuda or cpu.",
                        choices=["auto", "cuda", "cpu"])
    served_model_name: str | list[str] | None = _flag(
        None, "The model's name(s): the first is the one answers report, all are listed in "
        "/v1/models (default: the model folder's or GGUF file's name).", nargs="+")
    strict_model_name: bool = _flag(
        False, "Answer a request whose `model` names none of the served names (or the model's "
        "path) with 404 model_not_found; by default any name is served, as SGLang does.")
    host: str = _flag("127.0.0.1", "Address to listen on.")
    port: int = _flag(30000, "Port to listen on (0: any free port).")
    api_key: str | None = _flag(None, "Require `Authorization: Bearer KEY` on every request.")
    admin_api_key: str | None = _flag(
        None, "Require `Authorization: Bearer KEY` with this key (not --api-key's) on the "
        "endpoints that change the server: adapter loading, /flush_cache, aborting every "
        "request; it serves the other endpoints too.")
    shutdown_timeout: float = _flag(
        20.0, "On SIGTERM: answer new requests 503 (Retry-After) and let running ones finish "
        "for up to this many seconds, then abort the rest and exit 0 (SIGINT aborts at once).")
    stream_write_timeout: float = _flag(
        30.0, "Seconds a streaming response may wait for its client to read before its "
        "requests are aborted (a client that stops reading holds no more than the socket's "
        "buffers meanwhile).")
    allowed_hosts: str | None = _flag(
        None, "Comma-separated host names the Host header may name besides the bound address "
        "and localhost; '*' for any (default: any when bound to a non-loopback address).")
    cors_origins: str | None = _flag(
        None, "Comma-separated origins (e.g. http://localhost:3000) whose web pages may call "
        "this server; '*' for any. Default: none (browsers' cross-origin requests get 403).")
    max_request_bytes: int = _flag(32 * 2**20, "Largest request body; larger ones get 413.")
    max_stored_responses: int = _flag(
        1000, "Responses (/v1/responses with store) kept in memory for previous_response_id "
        "and GET /v1/responses/{id}; the oldest go first; 0 stores none.")
    max_sequences_per_request: int = _flag(
        1024, "Sequences one request may ask for (prompts x n).")
    max_stop_strings: int = _flag(64, "Stop strings one request may give.")
    max_stop_string_length: int = _flag(1024, "Characters in one stop string at most.")
    max_images_per_request: int = _flag(16, "Images one prompt may hold.")
    max_image_bytes: int = _flag(
        20 * 2**20, "Largest image file (fetched, base64 or read), in bytes.")
    max_image_pixels: int = _flag(
        64 * 2**20, "Largest image, in decoded pixels (width x height) before the model's "
        "processor resizes it.")
    image_fetch_timeout: float = _flag(10.0, "Seconds to fetch an http(s) image URL.")
    allowed_local_media_path: str | None = _flag(
        None, "A folder whose image files requests may name by path (file:// or a plain "
        "path); default: none (the offline LLM: any).")
    tp_size: int = _flag(1, "Tensor-parallel ranks.", "--tp")
    context_length: int | None = _flag(
        None, "Longest sequence (prompt + output); default: the model's.")
    max_running_requests: int | None = _flag(
        None, "Requests decoded together at most (default "
        f"{DEVICE_DEFAULTS['max_running_requests']['cuda']} on GPU, "
        f"{DEVICE_DEFAULTS['max_running_requests']['cpu']} on CPU).")
    max_total_tokens: int | None = _flag(
        None, "Tokens the KV pool holds (default: from --mem-fraction-static).")
    mem_fraction_static: float | None = _flag(
        None, "Share of device memory for weights + KV pool (GPU, default "
        f"{DEVICE_DEFAULTS['mem_fraction_static']['cuda']}) or of free RAM for the KV pool "
        f"(CPU, default {DEVICE_DEFAULTS['mem_fraction_static']['cpu']}).")
    max_queued_requests: int | None = _flag(
        None, "Waiting requests at most; beyond it new ones get HTTP 503.")
    chunked_prefill_size: int | None = _flag(
        None, "Most prompt tokens in one prefill batch; longer prompts are chunked (default "
        f"{DEFAULT_CHUNK}; on CPU at most what keeps one layer's widest activation (a gate/up "
        "output, a mixture's k rows per token) under 32 MiB, e.g. 4096 for the bundled model "
        f"in bf16, and {CPU_MIXED_CHUNK} with --enable-mixed-chunk, where the chunk bounds the "
        "running streams' inter-token stall).")
    page_size: int | None = _flag(
        None, "Tokens per KV page (default: "
        f"{DEVICE_DEFAULTS['page_size']['cuda']} on GPU; {DEVICE_DEFAULTS['page_size']['cpu']} "
        "on CPU, where reading a request's KV in runs of a page is much faster than from "
        "scattered tokens).")
    schedule_policy: str = _flag(
        "fcfs", "Order of the waiting queue: fcfs, lpm (longest cached prefix first), lof "
        "(longest output first) or random.", choices=["fcfs", "lpm", "lof", "random"])
    schedule_conservativeness: float = _flag(
        1.0, "How cautiously requests are admitted into a full KV pool: admission assumes this "
        "times the scheduler's estimate (0.7, decaying to 0.1 over 600 decode steps and raised "
        "after each retraction) of the share of each running request's remaining "
        "max_new_tokens still to come. Larger admits fewer and retracts less; smaller admits "
        "more and retracts more.")
    enable_priority_scheduling: bool = _flag(
        False, "Order the waiting queue by each request's `priority` (higher first), let an "
        "urgent request preempt a running one, and displace the least urgent waiting one "
        "when the queue is full.")
    schedule_low_priority_values_first: bool = _flag(
        False, "With priority scheduling: lower `priority` values are more urgent.")
    priority_scheduling_preemption_threshold: int = _flag(
        10, "With priority scheduling: how much more urgent a waiting request must be than a "
        "running one to preempt it.")
    enable_mixed_chunk: bool = _flag(
        False, "Run the decodes in the same forward as a prefill chunk, so streams keep "
        "producing tokens while a long prompt is prefilled.")
    quantization: str | None = _flag(
        None, "Weights kept compact: gguf (a GGUF model's block-quantized weights, k-quants "
        "included, run as in the file on CPU; the default for a GGUF model in bfloat16 where "
        "the AVX-512 VNNI kernel is built, or in the float32 --dtype auto picks on an AVX2 "
        "CPU), w8a8_int8 (linear weights int8 per output "
        "feature, activations int8 per token: for high-batch throughput on CPU in bfloat16), "
        "fp8 (linear weights float8 per output feature, weight-only: for decode speed on "
        "CUDA GPUs of compute capability 8.9+; an fp8 checkpoint's own weights on CPU), "
        "awq / gptq / compressed-tensors (int4 checkpoints, on CPU; a quantized checkpoint "
        "takes its own method by default), mxfp4 (gpt-oss's released experts, kept in their "
        "4-bit blocks on CPU) "
        "or none (every weight dequantized to --dtype; the default otherwise).",
        choices=["gguf", "w8a8_int8", "fp8", "awq", "gptq", "compressed-tensors", "mxfp4",
                 "none"])
    cpu_int8_activations: bool = _flag(
        False, "CPU kernels of quantized weights (--quantization gguf, quantized "
        "checkpoints) round each activation to one int8 per group of 32 inputs, as llama.cpp "
        "does, instead of two int8 terms (~15 bits): about half the integer work at prefill, "
        "speculative verify and large decode batches, for logits a few times further from "
        "the dequantized model's (BENCHMARKS.md). Needs AVX-512 VNNI.")
    kv_cache_dtype: str = _flag(
        "auto", "What the KV cache's pages hold: auto (the --dtype), int8 (CPU: a float32 "
        "scale per token and head, read by the attention kernels; about 1.9x the tokens in "
        "the same memory at head size 64), fp8_e4m3 / fp8_e5m2 (float8 values, saturated; "
        "CUDA through FlashInfer, CPU through the generic kernel), bf16 / bfloat16 (with "
        "--dtype bfloat16 the same as auto). Bounds measured: README, BENCHMARKS.md.",
        choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16"])
    disable_radix_cache: bool = _flag(False, "Use no prefix cache.")
    enable_hierarchical_cache: bool = _flag(
        False, "Keep the prefix cache's pages past the KV pool: in a host-memory tier (GPU; "
        "on CPU the pool is host memory already, so only with --hicache-size) and, with "
        "--hicache-storage-backend file, on disk (it survives a restart). A prefix the pool "
        "no longer holds is read back instead of recomputed. Not with hybrid models, "
        "STANDALONE speculation or --disable-radix-cache.")
    hicache_ratio: float = _flag(
        2.0, "GPU: the host tier's size as a multiple of the KV pool's (--hicache-size "
        "overrides it).")
    hicache_size: int = _flag(
        0, "The host tier's size in GB (0: --hicache-ratio on GPU, no host tier on CPU).")
    hicache_write_policy: str = _flag(
        "write_through", "When pages reach the lower tiers: write_through (when a request "
        "gives them to the prefix cache; write_through_selective the same) or write_back "
        "(when the pool evicts them).",
        choices=["write_through", "write_through_selective", "write_back"])
    hicache_io_backend: str = _flag(
        "kernel", "Accepted for SGLang's command lines: minisgl copies pages with torch ops "
        "either way.", choices=["kernel", "direct"])
    hicache_mem_layout: str = _flag(
        "layer_first", "Accepted for SGLang's command lines: the host tier keeps each page's "
        "layers together either way.", choices=["layer_first", "page_first", "page_first_direct"])
    hicache_storage_prefetch_policy: str = _flag(
        "best_effort", "Accepted for SGLang's command lines: a request whose prefix is on disk "
        "waits for its pages (other requests run meanwhile).",
        choices=["best_effort", "wait_complete", "timeout"])
    hicache_storage_backend: str | None = _flag(
        None, "The disk tier: file (one file per page under --hicache-storage-dir).",
        choices=["file"])
    hicache_storage_dir: str | None = _flag(
        None, "The disk tier's folder (default: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
        "else ~/.cache/minisgl/hicache); each model and layout gets a folder of its own in it.")
    hicache_storage_backend_extra_config: str | None = _flag(
        None, "JSON: max_size (the disk tier's limit: bytes or 10G / 64Gi; default "
        "$SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, else 16Gi, at most half the free space), "
        "storage_dir (as --hicache-storage-dir).")
    max_mamba_cache_size: int | None = _flag(
        None, "Hybrid models: recurrent states held in all, one per running request and the "
        "rest the prefix cache's snapshots (a cached prefix resumes only from the state at its "
        "end); default twice --max-running-requests.")
    mamba_ssm_dtype: str = _flag(
        "float32", "Hybrid models: the dtype the recurrent states (Mamba2's, Gated "
        "DeltaNet's) are kept in between steps. bfloat16 halves the bytes a step reads and "
        "writes and the pool's size, the updates still computed in float32, for one rounding "
        "of each state a step (BENCHMARKS.md); it runs on the CPU kernels.",
        choices=["float32", "bfloat16"])
    is_embedding: bool = _flag(
        False, "Serve the model as an embedding model: /v1/embeddings and /encode answer each "
        "input's final hidden state at its last token, L2-normalised (SGLang's pooling for "
        "decoder models); the generation endpoints are refused.")
    speculative_algorithm: str | None = _flag(
        None, "Speculative decoding: NGRAM drafts each request's next tokens from n-grams of "
        "its own prompt and output, STANDALONE with a smaller draft model "
        "(--speculative-draft-model-path); the model verifies them all in one forward "
        "(greedy and sampled outputs keep their distribution).")
    speculative_num_draft_tokens: int | None = _flag(
        None, "Tokens per request in a verify forward: its last token and up to this many "
        "minus one drafts (default: 6 on CPU, 8 on CUDA).")
    speculative_num_steps: int | None = _flag(
        None, "Drafted tokens per step (a chain: --speculative-num-draft-tokens minus one); "
        "give either, or both agreeing.")
    speculative_eagle_topk: int | None = _flag(
        None, "Branches per drafting step: 1 (chains; trees are not supported).")
    speculative_ngram_min_match_window_size: int = _flag(
        1, "NGRAM: the shortest suffix of a request's tokens looked up among its earlier "
        "tokens.")
    speculative_ngram_max_match_window_size: int = _flag(
        12, "NGRAM: the longest suffix looked up (longer matches are tried first).")
    speculative_always_draft: bool = _flag(
        False, "Speculate at every decode step (within the batch token budget), without "
        "measuring whether it pays; by default decode steps are timed with drafts and "
        "without, and drafting stops for a while where it is slower.")
    speculative_draft_model_path: str | None = _flag(
        None, "STANDALONE: the draft model (any model minisgl serves with the target's "
        "vocabulary, a folder or a .gguf file; the target's own weights in a cheaper form too).")
    speculative_draft_model_quantization: str | None = _flag(
        None, "STANDALONE: the draft model's --quantization (default: as --quantization's "
        "default for that model).", choices=["gguf", "w8a8_int8", "fp8", "none"])
    enable_lora: bool = _flag(
        False, "Serve LoRA adapters (PEFT folders) on top of the model, any mix of them in a "
        "batch; implied by --lora-paths.")
    lora_paths: list[str] | None = _flag(
        None, "Adapters to load at start: PATH, NAME=PATH or JSON {\"lora_name\": ..., "
        "\"lora_path\": ..., \"pinned\": ...}.", nargs="+")
    lora_dirs: list[str] | None = _flag(
        None, "Folders /load_lora_adapter may load adapters from (with the folders of "
        "--lora-paths); an adapter path outside them is refused with 403.", nargs="+")
    max_loras_per_batch: int = _flag(8, "Distinct adapters in one batch (its slots).")
    max_lora_rank: int | None = _flag(
        None, "Largest adapter rank served (default: the largest of --lora-paths, else 16).")
    lora_target_modules: list[str] | None = _flag(
        None, "Linears that take adapters: q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj (on a mixture of experts: the experts'), or all (default: those of "
        "--lora-paths, else all).", nargs="+")
    max_loaded_loras: int | None = _flag(
        None, "Adapters loaded at a time (default: no limit); at least "
        "--max-loras-per-batch.")
    disable_overlap_schedule: bool = _flag(
        False, "Process each batch's results before launching the next one.")
    num_continuous_decode_steps: int | None = _flag(
        None, "Decode steps one launch runs back to back while no request waits (the same "
        "tokens; a stream gets them that many at a time). Default: on CPU 4 while one request "
        "runs, else 1. Runs only on a CPU engine with --tp-size 1, without speculative "
        "decoding; requests with a grammar, penalties, images or min_new_tokens still to "
        "reach decode one step at a time.")
    attention_backend: str | None = _flag(
        None, "torch or flashinfer (default: flashinfer on CUDA for float16/bfloat16 when "
        "installed, else torch).",
        choices=["torch", "flashinfer"])
    cuda_graph_max_bs: int = _flag(160, "Largest decode batch captured in a CUDA graph.")
    disable_cuda_graph: bool = _flag(False, "Run decode eagerly on CUDA.")
    seed: int = _flag(
        0, "Seed of sampling for requests without a sampling_seed (they draw from one "
        "generator seeded with it, so two servers started with the same seed sample the same "
        "outputs for the same requests run in the same batches), of --schedule-policy random "
        "and of --load-format dummy's weights.", "--random-seed")
    log_level: str = _flag("info", "Logging level.", choices=["debug", "info", "warning", "error"])
    log_requests: bool = _flag(
        False, "Log one line per finished request: rid, lengths, cached tokens, TTFT, "
        "end-to-end latency, finish reason.")
    log_requests_level: int = _flag(
        0, "With --log-requests: 0 metadata only (no text); 1 also the sampling parameters; "
        "2 also the prompt and output cut to 2048 characters; 3 all of them.",
        choices=[0, 1, 2, 3])
    log_requests_format: str = _flag(
        "text", "With --log-requests: text (a log line) or json (a JSON object per line, on "
        "stdout).", "--log-format", choices=["text", "json"])

    def __post_init__(self) -> None:
        """Refuse impossible values with one line (the CLI exits with code 2)."""
        def flag(name: str) -> str:
            return "--" + name.replace("_", "-")

        for name in ("tp_size", "chunked_prefill_size", "cuda_graph_max_bs", "max_request_bytes",
                     "max_sequences_per_request", "max_stop_strings", "max_stop_string_length",
                     "max_images_per_request", "max_image_bytes", "max_image_pixels",
                     "max_running_requests", "max_total_tokens", "context_length",
                     "max_queued_requests", "page_size", "max_mamba_cache_size",
                     "num_continuous_decode_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{flag(name)} must be an integer >= 1, got {value!r}")
        threshold = self.priority_scheduling_preemption_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError("--priority-scheduling-preemption-threshold must be an integer "
                             f">= 0, got {threshold!r}")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port!r}")
        for name in ("image_fetch_timeout", "stream_write_timeout", "schedule_conservativeness"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        fraction = self.mem_fraction_static
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices is None or (value is None and f.default is None):
                continue
            if value not in choices or (isinstance(value, bool) and f.type != "bool"):
                raise ValueError(f"{flag(f.name)} must be one of "
                                 f"{', '.join(str(c) for c in choices)}, got {value!r}")
        check_parsers(self)
        check_speculation(self)
        check_lora(self)
        check_hierarchical_cache(self)
        if self.is_embedding and self.speculative_algorithm is not None:
            raise ValueError("--is-embedding generates no tokens: --speculative-algorithm "
                             "does not apply")
        names = self.served_model_names
        if self.served_model_name is not None and not (
                names and all(isinstance(n, str) and n for n in names)):
            raise ValueError("--served-model-name takes one or more non-empty names, got "
                             f"{self.served_model_name!r}")
        if not self.host:
            raise ValueError("--host must not be empty")
        template = self.chat_template
        if template is not None and not (_is_file(template) or "{{" in template
                                         or "{%" in template):
            raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja "
                             "template")

    def lora_adapters(self) -> list[tuple[str, str, bool]]:
        """--lora-paths as (name, path, pinned), in order."""
        return lora_adapters(self.lora_paths)

    @property
    def served_model_names(self) -> list[str]:
        """--served-model-name as a list (one name given as a string, or several)."""
        names = self.served_model_name
        return [] if names is None else [names] if isinstance(names, str) else list(names)

    def chat_template_text(self) -> str | None:
        """--chat-template's Jinja: the file's contents, or the flag's value itself."""
        template = self.chat_template
        if template is not None and _is_file(template):
            return Path(template).read_text()
        return template

    @staticmethod
    def split_list(value: str | None) -> list[str] | None:
        """A comma-separated flag as a list (None stays None)."""
        if value is None:
            return None
        return [item.strip() for item in value.split(",") if item.strip()]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            names = [flag, *f.metadata.get("aliases", ())]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default,
                                      "help": f.metadata.get("help")}
            if f.type == "bool":
                parser.add_argument(*names, action="store_true", **kwargs)
                continue
            kind = {"int": int, "int | None": int, "float": float,
                    "float | None": float}.get(str(f.type), str)
            if f.metadata.get("nargs"):
                kwargs["nargs"] = f.metadata["nargs"]
            parser.add_argument(*names, type=kind, choices=f.metadata.get("choices"), **kwargs)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(namespace).items() if k in names})

    def pick(self, config_type: type[T]) -> T:
        """A layer's config (EngineConfig, SchedulerConfig: see `flag_config`) filled from
        these flags."""
        return config_type(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(config_type)})

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        for secret in ("api_key", "admin_api_key"):
            if values.get(secret):
                values[secret] = "<set>"
        return values


def flag_config(cls: type[T]) -> type[T]:
    """Make `cls` a frozen dataclass of the flags its annotations name: each field defaults to
    its ServerArgs default, so a layer's config holds no default of its own. An annotation that
    names no flag, or disagrees with the flag's type, is a TypeError at import."""
    flags = {f.name: f for f in dataclasses.fields(ServerArgs)}
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        flag = flags.get(name)
        if flag is None or str(annotation) != str(flag.type):
            raise TypeError(f"{cls.__name__}.{name}: {annotation} is no ServerArgs field of "
                            "that type")
        if name in cls.__dict__:
            raise TypeError(f"{cls.__name__}.{name}: the default belongs to ServerArgs")
        setattr(cls, name, flag.default)
    return dataclass(frozen=True)(cls)

"""Every knob of an engine or server, with SGLang's flag names, and its command-line parser."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


def _flag(default: Any, help: str, *aliases: str, choices: list[str] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "aliases": aliases, "choices": choices})


@dataclass
class ServerArgs:
    model_path: str | None = _flag(
        None, "Hugging Face model folder, .gguf file or shipped config name "
        "(default: the bundled SmolLM2-135M-Instruct).", "--model")
    tokenizer_path: str | None = _flag(None, "Tokenizer folder (default: the model's).")
    json_model_override_args: str | None = _flag(
        None, 'JSON object merged into the model config, e.g. \'{"num_hidden_layers": 2}\'.')
    load_format: str = _flag("auto", "auto: read the weights; dummy: random weights from the "
                             "config alone (benchmarks).", choices=["auto", "dummy"])
    dtype: str = _flag("auto", "auto (bfloat16), bfloat16, float16 or float32.",
                       choices=["auto", "bfloat16", "float16", "float32"])
    device: str = _flag("auto", "auto (cuda when available, else cpu), cuda or cpu.",
                        choices=["auto", "cuda", "cpu"])
    host: str = _flag("127.0.0.1", "Address to listen on.")
    port: int = _flag(30000, "Port to listen on.")
    api_key: str | None = _flag(None, "Require `Authorization: Bearer KEY` on every request.")
    tp_size: int = _flag(1, "Tensor-parallel ranks.", "--tp")
    context_length: int | None = _flag(
        None, "Longest sequence (prompt + output); default: the model's.")
    max_running_requests: int | None = _flag(
        None, "Requests decoded together at most (default 256 on GPU, 128 on CPU).")
    max_total_tokens: int | None = _flag(
        None, "Tokens the KV pool holds (default: from --mem-fraction-static).")
    mem_fraction_static: float | None = _flag(
        None, "Share of device memory for weights + KV pool (GPU, default 0.85) or of free RAM "
        "for the KV pool (CPU, default 0.25).")
    max_queued_requests: int | None = _flag(
        None, "Waiting requests at most; beyond it new ones get HTTP 503.")
    chunked_prefill_size: int = _flag(
        8192, "Most prompt tokens in one prefill batch; longer prompts are chunked.")
    page_size: int | None = _flag(
        None, "Tokens per KV page (default: 1 on GPU; 16 on CPU, where reading a request's KV "
        "in runs of a page is much faster than from scattered tokens).")
    schedule_policy: str = _flag("fcfs", "Order of the waiting queue: fcfs or lpm (longest "
                                 "prefix match first).", choices=["fcfs", "lpm"])
    disable_radix_cache: bool = _flag(False, "Use no prefix cache.")
    disable_overlap_schedule: bool = _flag(
        False, "Process each batch's results before launching the next one.")
    attention_backend: str | None = _flag(
        None, "torch or flashinfer (default: flashinfer on CUDA for float16/bfloat16 when "
        "installed, else torch).",
        choices=["torch", "flashinfer"])
    cuda_graph_max_bs: int = _flag(160, "Largest decode batch captured in a CUDA graph.")
    disable_cuda_graph: bool = _flag(False, "Run decode eagerly on CUDA.")
    seed: int = _flag(0, "Seed of the sampler for requests without a sampling_seed.")
    log_level: str = _flag("info", "Logging level.", choices=["debug", "info", "warning", "error"])

    def __post_init__(self) -> None:
        for name in ("tp_size", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_running_requests", "max_total_tokens", "context_length",
                     "max_queued_requests", "page_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")

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
            kind = {"int": int, "int | None": int, "float | None": float}.get(str(f.type), str)
            parser.add_argument(*names, type=kind, choices=f.metadata.get("choices"), **kwargs)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(namespace).items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if values.get("api_key"):
            values["api_key"] = "<set>"
        return values

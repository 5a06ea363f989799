"""Checks of the flags that come in groups (speculative decoding, LoRA), kept out of args.py:
each takes the ServerArgs being built and refuses impossible values with one line."""

from __future__ import annotations

import json
from typing import Any

HARMONY_PARSER = "gpt-oss"  # both parser flags' name for the harmony format
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")
MAX_DRAFT_TOKENS = 64


def check_parsers(args: Any) -> None:
    """gpt-oss on either parser flag reads harmony answers, which carry the reasoning and the
    tool calls together: the other flag becomes gpt-oss too (left at its default, or given as
    gpt-oss); any other value is refused."""
    if HARMONY_PARSER not in (args.tool_call_parser, args.reasoning_parser):
        return
    if (args.reasoning_parser not in (None, HARMONY_PARSER)
            or args.tool_call_parser not in ("hermes", HARMONY_PARSER)):
        raise ValueError("--reasoning-parser gpt-oss and --tool-call-parser gpt-oss read the "
                         "harmony format together: give both as gpt-oss (or only one)")
    args.tool_call_parser = args.reasoning_parser = HARMONY_PARSER


def check_speculation(args: Any) -> None:
    """--speculative-*: refuse what cannot run, fill --speculative-num-draft-tokens."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        given = [name for name in ("speculative_num_draft_tokens", "speculative_num_steps",
                                   "speculative_always_draft",
                                   "speculative_eagle_topk", "speculative_draft_model_path",
                                   "speculative_draft_model_quantization")
                 if getattr(args, name) not in (None, False)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs "
                             "--speculative-algorithm")
        return
    if not isinstance(algorithm, str) or algorithm.upper() not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm} is not supported; minisgl "
                         f"speculates with {' or '.join(SPECULATIVE_ALGORITHMS)} (EAGLE and "
                         "the rest are not implemented)")
    args.speculative_algorithm = algorithm = algorithm.upper()
    draft = args.speculative_draft_model_path
    if algorithm == "STANDALONE" and draft is None:
        raise ValueError("--speculative-algorithm STANDALONE needs "
                         "--speculative-draft-model-path")
    if algorithm != "STANDALONE":
        for name in ("speculative_draft_model_path", "speculative_draft_model_quantization"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --speculative-algorithm "
                                 "STANDALONE")
    for name in ("speculative_num_draft_tokens", "speculative_num_steps",
                 "speculative_eagle_topk", "speculative_ngram_min_match_window_size",
                 "speculative_ngram_max_match_window_size"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_DRAFT_TOKENS):
            raise ValueError(f"--{name.replace('_', '-')} must be an integer in "
                             f"[1, {MAX_DRAFT_TOKENS}], got {value!r}")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError("--speculative-eagle-topk must be 1: minisgl drafts chains, not "
                         "trees")
    steps, tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if tokens is not None and tokens < 2:
        raise ValueError("--speculative-num-draft-tokens must be >= 2 (the last token and "
                         "at least one draft)")
    if steps is not None and tokens is not None and tokens != steps + 1:
        raise ValueError(f"--speculative-num-draft-tokens ({tokens}) must be "
                         f"--speculative-num-steps ({steps}) + 1 for a chain")
    if steps is not None:
        args.speculative_num_draft_tokens = steps + 1
    if (args.speculative_ngram_min_match_window_size
            > args.speculative_ngram_max_match_window_size):
        raise ValueError("--speculative-ngram-min-match-window-size must not exceed "
                         "--speculative-ngram-max-match-window-size")


def check_lora(args: Any) -> None:
    """--enable-lora and its flags."""
    if args.lora_paths:
        args.enable_lora = True
    for name in ("max_loras_per_batch", "max_lora_rank", "max_loaded_loras"):
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got "
                             f"{value!r}")
    if (args.max_loaded_loras is not None
            and args.max_loaded_loras < args.max_loras_per_batch):
        raise ValueError("--max-loaded-loras must be at least --max-loras-per-batch")
    lora_adapters(args.lora_paths)  # NOTE: refuses a malformed entry at start


def lora_adapters(entries: list[str] | None) -> list[tuple[str, str, bool]]:
    """--lora-paths as (name, path, pinned), in order."""
    adapters = []
    for entry in entries or []:
        if entry.lstrip().startswith("{"):
            try:
                item = json.loads(entry)
                adapters.append((item["lora_name"], item["lora_path"],
                                 bool(item.get("pinned", False))))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-paths: {entry!r} is not a JSON object with "
                                 "lora_name and lora_path") from None
        else:
            name, _, path = entry.partition("=") if "=" in entry else (entry, "", entry)
            adapters.append((name, path, False))
    return adapters

"""Checks of the flags that come in groups (speculative decoding, LoRA), kept out of args.py:
each takes the ServerArgs being built and refuses impossible values with one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
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
    if args.lora_paths or args.lora_dirs:
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
    for folder in args.lora_dirs or []:
        if not Path(folder).is_dir():
            raise ValueError(f"--lora-dirs: {folder} is not a folder")


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


HICACHE_EXTRA_KEYS = ("max_size", "storage_dir")


def check_hierarchical_cache(args: Any) -> None:
    """--enable-hierarchical-cache and --hicache-*: refuse what cannot work together."""
    if args.hicache_storage_backend is not None and not args.enable_hierarchical_cache:
        raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.hicache_size < 0 or not args.hicache_ratio > 0:
        raise ValueError("--hicache-size must be >= 0 and --hicache-ratio > 0")
    extra = hicache_extra_config(args.hicache_storage_backend_extra_config)
    if not args.enable_hierarchical_cache:
        return
    if args.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache extends the prefix cache: not with "
                         "--disable-radix-cache")
    if args.speculative_algorithm == "STANDALONE":
        raise ValueError("--enable-hierarchical-cache keeps no draft model's KV: not with "
                         "--speculative-algorithm STANDALONE")
    if extra and args.hicache_storage_backend is None:
        raise ValueError("--hicache-storage-backend-extra-config needs "
                         "--hicache-storage-backend")


def hicache_extra_config(text: str | None) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config as a dict of the keys minisgl reads."""
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
    unknown = sorted(set(extra) - set(HICACHE_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"--hicache-storage-backend-extra-config: unknown key {unknown[0]!r} "
                         f"(minisgl reads {', '.join(HICACHE_EXTRA_KEYS)})")
    if "max_size" in extra:
        parse_size(extra["max_size"])
    return extra


_SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: object) -> int:
    """Bytes from an int or a string like 10G, 64Gi, 512M (B suffix allowed)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(value).lower())
    if isinstance(value, bool) or match is None:
        raise ValueError(f"not a size: {value!r} (bytes, or e.g. 10G, 64Gi)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])

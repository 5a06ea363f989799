"""A hybrid's prefix cache: time to the first token of a prompt sent cold, sent again (a full
hit: it resumes from the state snapshot at the page boundary before its last token) and
continued by a next turn (it resumes from the snapshot the first request left at its end),
each round on a fresh random prompt, in one engine. Model: Qwen3.5-35B-A3B's shape with dense
MLPs (as `hybrid`), random weights, bf16.

    python -m minisgl.bench hybrid-prefix                     # 2048-token prompts, 4 layers
    python -m minisgl.bench hybrid-prefix --tokens 512 4096 --layers 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisgl.bench.hybrid import HYBRID, SHARED
from minisgl.llm import LLM

TURN_TOKENS = 32  # a next turn's new tokens after the first request's prompt and answer
ANSWER_TOKENS = 16


def first_token_ms(llm: LLM, ids: list[int], new_tokens: int = 1) -> tuple[float, dict]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    out = llm.generate(input_ids=[ids], sampling_params=params)[0]
    return (time.perf_counter() - started) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--snapshots", type=int, default=32,
                        help="state snapshots the prefix cache may hold")
    args = parser.parse_args()
    name, fields = HYBRID
    overrides = {**SHARED, **fields, "num_hidden_layers": args.layers,
                 "max_position_embeddings": 40960}
    longest = max(args.tokens) + ANSWER_TOKENS + TURN_TOKENS + 16
    print("| prompt tokens | cold ms | again ms (cached) | next turn ms (cached) | "
          "cold / again | cold / next turn |")
    print("|---|---|---|---|---|---|")
    with LLM(model=name, load_format="dummy", dtype="bfloat16", max_running_requests=4,
             max_mamba_cache_size=4 + args.snapshots, max_total_tokens=8 * longest,
             json_model_override_args=json.dumps(overrides)) as llm:
        gen = torch.Generator().manual_seed(0)
        for tokens in args.tokens:
            times: dict[str, list[float]] = {"cold": [], "again": [], "turn": []}
            cached: dict[str, int] = {}
            for _ in range(args.rounds):
                ids = torch.randint(10, 200_000, (tokens,), generator=gen).tolist()
                _, out = first_token_ms(llm, ids, ANSWER_TOKENS)
                cold_prefill, _ = first_token_ms(llm, ids[::-1])  # cold: nothing of it cached
                again, hit = first_token_ms(llm, ids)
                turn_ids = ids + out["output_ids"] + list(range(100, 100 + TURN_TOKENS))
                turn, turn_hit = first_token_ms(llm, turn_ids)
                times["cold"].append(cold_prefill)
                times["again"].append(again)
                times["turn"].append(turn)
                cached = {"again": hit["meta_info"]["cached_tokens"],
                          "turn": turn_hit["meta_info"]["cached_tokens"]}
            cold, again, turn = (statistics.median(times[k]) for k in ("cold", "again", "turn"))
            print(f"| {tokens} | {cold:.0f} | {again:.0f} ({cached['again']}) | {turn:.0f} "
                  f"({cached['turn']}) | {cold / again:.1f}x | {cold / turn:.1f}x |")


if __name__ == "__main__":
    main()

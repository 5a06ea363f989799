"""What grammar-constrained decoding costs: output tok/s of `LLM.generate` at one concurrency
with 0%, 50% and 100% of the requests under a grammar, rounds alternating, and the time the
scheduler spends filling the grammar masks per step.

    python -m minisgl.bench grammar --concurrency 32 --output-len 64 --rounds 2

Every request runs to --output-len: the free ones ignore EOS, the constrained ones follow a
regex far longer than the output (`[a-z ]{2000}`), so both kinds do the same work.
"""

from __future__ import annotations

import argparse
import time

from minisgl import LLM
from minisgl.scheduler.batch_builder import ScheduledBatch

GRAMMAR = {"regex": "[a-z ]{2000}"}


class MaskTimer:
    """Wall time of ScheduledBatch.fill_masks (on the scheduler's thread), per call."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        original = ScheduledBatch.fill_masks

        def timed(batch: ScheduledBatch) -> None:
            grammar = batch.fwd.grammar
            if grammar is None or grammar.filled:
                return
            started = time.perf_counter()
            original(batch)
            self.seconds += time.perf_counter() - started
            self.calls += 1
            self.rows += len(grammar.row_ids)

        ScheduledBatch.fill_masks = timed  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    timer = MaskTimer()
    n = args.concurrency
    prompts = [[100 + (7 * i + j) % 20000 for j in range(args.input_len)] for i in range(n)]
    with LLM(dtype=args.dtype, max_running_requests=n,
             max_total_tokens=n * (args.input_len + args.output_len + 32)) as llm:
        free = {"max_new_tokens": args.output_len, "temperature": 0.8, "ignore_eos": True}
        llm.generate(input_ids=prompts[:2], sampling_params=[free, {**free, **GRAMMAR}])
        print(f"{args.dtype}, {n} streams, {args.input_len} in / {args.output_len} out")
        print("| grammar share | output tok/s per round | mask fill per step | rows per step |")
        print("|---|---|---|---|")
        results: dict[float, list[float]] = {0.0: [], 0.5: [], 1.0: []}
        fills: dict[float, list[tuple[float, int, int]]] = {share: [] for share in results}
        for _ in range(args.rounds):
            for share in results:
                constrained = int(n * share)
                params = [{**free, **GRAMMAR} if i < constrained else free for i in range(n)]
                timer.seconds, timer.calls, timer.rows = 0.0, 0, 0
                started = time.perf_counter()
                outs = llm.generate(input_ids=prompts, sampling_params=params)
                wall = time.perf_counter() - started
                tokens = sum(len(o["output_ids"]) for o in outs)
                results[share].append(tokens / wall)
                fills[share].append((timer.seconds, timer.calls, timer.rows))
        for share, rates in results.items():
            seconds = sum(f[0] for f in fills[share])
            calls = sum(f[1] for f in fills[share])
            rows = sum(f[2] for f in fills[share])
            per_step = f"{seconds / calls * 1e3:.2f} ms" if calls else "-"
            print(f"| {share:.0%} | {' / '.join(f'{r:.0f}' for r in rates)} | {per_step} | "
                  f"{rows / calls if calls else 0:.0f} |")


if __name__ == "__main__":
    main()

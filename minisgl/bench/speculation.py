"""Speculative decoding (--speculative-algorithm NGRAM, or STANDALONE with --draft-model)
on vs off, side by side in one run.

Two workloads of chat prompts to the bundled model, greedy:
- grounded: rewrite, repeat, extract from or continue a given text (passages of this repo's
  docs): the output copies the input, where n-gram drafts are right;
- chat: open questions, where they are mostly wrong.
`--streams C` requests decode at once (max_running_requests C, max(2C, --min-requests)
requests, so every step has C rows once the first prefills are done). Output tok/s = output
tokens / wall time, prefill included; "accept" is the mean tokens a speculating request gained
per verify step.

Each side runs in a fresh process, `--rounds` times, the order alternating (off, on, on, off,
...) so that a machine drifting during the run weighs on both sides alike; a figure is the mean
over rounds, the spread the lowest and highest on / off of a round's pair.

    python -m minisgl.bench speculation --streams 1 8 32 64
    python -m minisgl.bench speculation --streams 1 --overlap-too   # overlap vs not, spec on
    python -m minisgl.bench speculation --streams 1 --cpu-int8-activations  # both sides so
    python -m minisgl.bench speculation --linears   # a verify step's few rows: GEMM vs kernel
    python -m minisgl.bench speculation --draft-model bundled    # STANDALONE, itself as draft
    python -m minisgl.bench speculation --draft-model bundled --draft-layers 8  # its first 8
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minisgl import LLM
from minisgl.layers.linear import FEW_ROWS, few_rows_matmul
from minisgl.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("Repeat the following text exactly, word for word:\n\n{}",
         "Rewrite the following text, keeping every sentence but fixing the grammar:\n\n{}",
         "Copy the sentences of this text that mention a flag or a file:\n\n{}",
         "Continue this text where it stops, in the same words where it repeats itself:\n\n{}")
QUESTIONS = ("What is the boiling point of water?", "Write a haiku about autumn.",
             "Give me three tips for learning a new language.",
             "Explain why the sky is blue in two sentences.",
             "Write a short story about a robot who learns to paint.",
             "What are the benefits of regular exercise?",
             "Describe your ideal weekend.", "How do vaccines work?",
             "Suggest a name for a coffee shop and explain it.",
             "What is the difference between weather and climate?",
             "Write a limerick about a cat.", "List five fruits and their colors.")


def passages(count: int, words: int = 90) -> list[str]:
    """Paragraphs of plain prose from the user documentation (README.md, then docs/ in name
    order, design.md aside), about `words` words each."""
    pages = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                         if p.name != "design.md")]
    text = "\n\n".join(page.read_text() for page in pages)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    prose = [p for p in paragraphs if len(p.split()) > 30 and not p.startswith(("```", "|", "#"))]
    return [" ".join(p.split()[:words]) for p in (prose * count)[:count]]


def chat_prompts(workload: str, count: int) -> list[str]:
    if workload == "grounded":
        return [TASKS[i % len(TASKS)].format(p) for i, p in enumerate(passages(count))]
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(count)]


def run_workload(workload: str, streams: int, spec: bool, args: argparse.Namespace,
        overlap: bool = True) -> tuple[float, float, int]:
    """(output tok/s, mean accepted length, output tokens), in this process."""
    extra = {}
    if spec:
        extra = ({"speculative_algorithm": "NGRAM"} if args.draft_model is None else
                 {"speculative_algorithm": "STANDALONE",
                  "speculative_draft_model_path": args.draft_model})
    if args.num_draft_tokens and spec:
        extra["speculative_num_draft_tokens"] = args.num_draft_tokens
    with LLM(dtype=args.dtype, max_running_requests=streams, max_total_tokens=args.pool,
             disable_overlap_schedule=not overlap,
             cpu_int8_activations=args.cpu_int8_activations, **extra) as llm:
        chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                   tokenize=False, add_generation_prompt=True)
                 for p in chat_prompts(workload, max(2 * streams, args.min_requests))]
        params = {"temperature": 0, "max_new_tokens": args.output_len}
        llm.generate(chats[:1], {**params, "max_new_tokens": 4})  # warm up
        before = llm.runtime.state()
        started = time.perf_counter()
        outs = llm.generate(chats, params)
        seconds = time.perf_counter() - started
        state = llm.runtime.state()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    rows = state["spec_verified_rows"] - before["spec_verified_rows"]
    accepted = state["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return tokens / seconds, (accepted + rows) / rows if rows else 1.0, tokens


Side = tuple[bool, bool]  # (speculating, overlap)
Run = tuple[float, float, int]  # run_workload()'s


def alternated(workload: str, streams: int, sides: list[Side], args: argparse.Namespace
               ) -> dict[Side, list[Run]]:
    """Each side's run_workload() results over args.rounds rounds, each run in its own process, the
    sides' order reversed every other round."""
    results: dict[Side, list[Run]] = {side: [] for side in sides}
    # the child takes this command line, the draft model resolved (--draft-model bundled)
    draft = [] if args.draft_model is None else ["--draft-model", args.draft_model]
    command = [sys.executable, "-m", "minisgl.bench", "speculation", *sys.argv[1:], *draft,
               "--one"]
    for round_ in range(args.rounds):
        for spec, overlap in sides if round_ % 2 == 0 else sides[::-1]:
            one = f"{workload},{streams},{int(spec)},{int(overlap)}"
            out = subprocess.run([*command, one], check=True, capture_output=True,
                                 text=True).stdout
            results[(spec, overlap)].append(tuple(json.loads(out.splitlines()[-1])))
    return results


def mean(runs: list[Run], field: int) -> float:
    return sum(r[field] for r in runs) / len(runs)


def spread(a: list[Run], b: list[Run]) -> str:
    """' (lo-hi)': the lowest and highest a / b tok/s of the rounds' pairs (one round: '')."""
    ratios = [x[0] / y[0] for x, y in zip(a, b)]
    return f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""


def bundled_draft(layers: int | None) -> str:
    """The bundled model as a draft model folder: whole, or cut to its first `layers`."""
    source = resolve_model_path(None)
    if layers is None:
        return str(source)
    folder = Path(tempfile.mkdtemp(prefix="draft-"))
    for file in source.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return str(folder)


def linears(dtype: torch.dtype, rounds: int = 5) -> None:
    """ms per pass over the bundled model's 30 x 4 linears (random weights, streamed from
    memory as in a step) at 1-8 rows: torch's GEMM against layers.linear.few_rows_matmul."""
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    weights = [torch.randn(o, i).to(dtype) for _ in range(30) for o, i in shapes]
    print(f"| rows | torch {dtype} ms | kernel ms | torch / kernel |")
    print("|---|---|---|---|")
    for rows in range(1, FEW_ROWS + 1):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(dtype) for w in weights}
        times = []
        for fn in (lambda x, w: torch.nn.functional.linear(x, w), few_rows_matmul):
            best = float("inf")
            for _ in range(rounds):
                started = time.perf_counter()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best = min(best, time.perf_counter() - started)
            times.append(best * 1e3)
        print(f"| {rows} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--workloads", nargs="+", default=["grounded", "chat"])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=16,
                        help="requests per row at least (2 x streams otherwise)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--pool", type=int, default=60000)
    parser.add_argument("--cpu-int8-activations", action="store_true",
                        help="both sides with one-int8-term activations (llama.cpp's numerics)")
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--draft-model", default=None,
                        help="STANDALONE with this draft model (bundled: the bundled model)")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="with --draft-model bundled: only its first N layers")
    parser.add_argument("--overlap-too", action="store_true",
                        help="with speculation: overlap on vs off")
    parser.add_argument("--rounds", type=int, default=2,
                        help="fresh-process runs of each side, in alternating order")
    parser.add_argument("--linears", action="store_true",
                        help="only the linears at 1-8 rows, float32 and bfloat16")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: workload,streams,spec,overlap
    args = parser.parse_args()
    if args.one:
        workload, streams, spec, overlap = args.one.split(",")
        print(json.dumps(run_workload(workload, int(streams), spec == "1", args, overlap == "1")))
        return
    if args.linears:
        for dtype in (torch.float32, torch.bfloat16):
            linears(dtype)
        return
    if args.draft_model == "bundled":
        args.draft_model = bundled_draft(args.draft_layers)
    name = "NGRAM" if args.draft_model is None else "STANDALONE"
    print(f"| workload | streams | off tok/s | {name} tok/s | {name} / off | accept length | "
          "output tokens (off / on) |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        for streams in args.streams:
            sides = [(False, True), (True, True)] + ([(True, False)] if args.overlap_too else [])
            results = alternated(workload, streams, sides, args)
            off, on = results[sides[0]], results[sides[1]]
            print(f"| {workload} | {streams} | {mean(off, 0):.1f} | {mean(on, 0):.1f} | "
                  f"{mean(on, 0) / mean(off, 0):.2f}x{spread(on, off)} | {mean(on, 1):.2f} | "
                  f"{off[0][2]} / {on[0][2]} |", flush=True)
            if args.overlap_too:
                plain = results[sides[2]]
                print(f"| {workload} (no overlap) | {streams} | | {mean(plain, 0):.1f} | "
                      f"overlap / none {mean(on, 0) / mean(plain, 0):.2f}x{spread(on, plain)} "
                      f"| {mean(plain, 1):.2f} | |", flush=True)


if __name__ == "__main__":
    main()

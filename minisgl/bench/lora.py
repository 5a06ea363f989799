"""Multi-LoRA throughput: output tok/s at 1 / 32 / 64 concurrent streams with 0, 1 and 8
distinct adapters in the batch (rank 16 on every linear), beside the same model served without
--enable-lora, all in one run on one machine (offline LLM, greedy, fixed lengths).

    python -m minisgl.bench lora [--streams 1 32 64] [--input-len 64] [--output-len 64]
                                 [--repeats 3] [--dtype auto]

The adapters are random PEFT adapters made once under ~/.cache/minisgl/lora-bench.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minisgl.env import cache_root
from minisgl.llm import LLM
from minisgl.models import resolve_model_path

ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(model: torch.nn.Module, rank: int, path: Path) -> None:
    """A PEFT adapter of `rank` on every linear of `model`, its weights random (not PEFT's
    zero B), saved at `path`."""
    import peft
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(path)


def make_adapters(base: Path, root: Path) -> list[Path]:
    import transformers
    paths = [root / f"r{RANK}-{i}" for i in range(ADAPTERS)]
    for i, path in enumerate(paths):
        if (path / "adapter_config.json").exists():
            continue
        torch.manual_seed(i)
        save_random_adapter(transformers.AutoModelForCausalLM.from_pretrained(base), RANK, path)
    return paths


def throughput(llm: LLM, streams: int, adapters: int, args: argparse.Namespace) -> float:
    prompts = [torch.randint(100, 40000, (args.input_len,),
                             generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(streams)]
    names = [f"a{i % adapters}" if adapters else None for i in range(streams)]
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    kwargs = {"lora_path": names} if adapters else {}
    llm.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4},
                 **({"lora_path": names[:2]} if adapters else {}))  # warm-up
    best = 0.0  # NOTE: the best of --repeats runs: one run is noisy on a small machine
    for _ in range(args.repeats):
        started = time.perf_counter()
        llm.generate(input_ids=prompts, sampling_params=params, **kwargs)
        best = max(best, streams * args.output_len / (time.perf_counter() - started))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = resolve_model_path(None)
    paths = make_adapters(base, cache_root() / "lora-bench")
    common = dict(dtype=args.dtype, max_running_requests=max(args.streams),
                  max_total_tokens=max(args.streams) * (args.input_len + args.output_len) + 4096)
    results: dict[str, dict[int, float]] = {}
    with LLM(**common) as llm:
        results["no --enable-lora"] = {s: throughput(llm, s, 0, args) for s in args.streams}
    with LLM(**common, max_loras_per_batch=ADAPTERS,
             lora_paths=[f"a{i}={p}" for i, p in enumerate(paths)]) as llm:
        for adapters in (0, 1, ADAPTERS):
            results[f"{adapters} adapters"] = {
                s: throughput(llm, s, min(adapters, s), args) for s in args.streams}
    base_rate = results["no --enable-lora"]
    print(f"{'':>18}" + "".join(f"{s:>10} streams" for s in args.streams))
    for name, rates in results.items():
        print(f"{name:>18}" + "".join(f"{rates[s]:>10.1f} tok/s" for s in args.streams))
        print(f"{'':>18}" + "".join(f"{rates[s] / base_rate[s]:>10.2f}x     "
                                    for s in args.streams))


if __name__ == "__main__":
    main()

"""Kernel breakdown of bs=1 decode on CUDA (dummy weights), eager and with CUDA graphs.

    python -m minisgl.bench gpu-profile [--model llama-3.1-8b]

Generates 65 tokens after a 512-token prompt under torch.profiler and prints, per mode, the
kernels by total GPU time (count, mean). BENCHMARKS.md's GPU decode breakdown came from this.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from minisgl import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, default=28, help="kernels to list per mode")
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(10000) for _ in range(512)]
    params = {"max_new_tokens": 65, "ignore_eos": True, "temperature": 0}
    for graphs in (False, True):
        with LLM(model=args.model, load_format="dummy", device="cuda", dtype="bfloat16",
                 max_running_requests=4, context_length=1024,
                 disable_cuda_graph=not graphs) as llm:
            llm.generate(input_ids=prompt, sampling_params={**params, "max_new_tokens": 8})
            started = time.perf_counter()
            llm.generate(input_ids=prompt, sampling_params=params)
            print(f"graphs={graphs}: 65 tokens in {time.perf_counter() - started:.3f} s")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(input_ids=prompt, sampling_params=params)
        kernels = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                         key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in kernels)
        print(f"graphs={graphs}: {total / 1e3:.1f} ms of GPU time in "
              f"{sum(e.count for e in kernels)} kernels")
        for e in kernels[: args.rows]:
            print(f"{e.device_time_total / 1e3:9.2f} ms {e.count:6d} "
                  f"{e.device_time_total / e.count:8.1f} us  {e.key[:110]}")


if __name__ == "__main__":
    main()

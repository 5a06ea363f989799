"""The machine's streaming read bandwidth, as the engine's threads see it: the best of several
reads of a buffer far larger than the caches, on the engine's torch threads, each read both as
torch's sum and as the CPU kernels' stream_read (the widest loads, one contiguous share a
thread, as the decode kernels stream a weight): on some hosts the sum reads well below what
the kernels stream. The bandwidth-utilisation figures (MBU: bytes a step must read / its time /
this) divide by it, measured in the same run; `gguf_bytes_per_token` gives llama.cpp's side of
them.

    python -m minisgl.bench bandwidth [--mib 1024] [--repeats 15]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def streaming_read_gbps(mib: int = 1024, repeats: int = 15) -> float:
    """GB/s of the best of `repeats` full reads of a `mib`-MiB buffer (its pages mapped first)
    on the calling thread's torch threads, each read made by torch's sum and by stream_read."""
    from minisgl.kernels.cpu import cpu_kernels
    buffer = torch.ones(mib * 2**18, dtype=torch.float32)
    kernels = cpu_kernels()
    readers = [buffer.sum] + ([lambda: kernels.stream_read(buffer)] if kernels else [])
    best = float("inf")
    for _ in range(repeats):
        for read in readers:
            started = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - started)
    return buffer.numel() * 4 / best / 1e9


def gguf_bytes_per_token(path: Path) -> tuple[int, int]:
    """What llama.cpp reads per decode token of a GGUF file: (weight bytes: every tensor as
    stored but the token table, which it reads one row of, unless the output head is tied to
    it; KV bytes per token of context, its default float16 cache)."""
    from minisgl.models.gguf_reader import gguf_reader
    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str) -> int | None:
        found = reader.fields.get(f"{arch}.{key}")
        return None if found is None else int(found.contents())

    names = {t.name for t in reader.tensors}
    weights = sum(int(t.n_bytes) for t in reader.tensors
                  if t.name != "token_embd.weight" or "output.weight" not in names)
    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv") or 0
    head_dim = field("attention.key_length") or field("embedding_length") // heads
    return weights, field("block_count") * 2 * kv_heads * head_dim * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"streaming read, {torch.get_num_threads()} threads, {args.mib} MiB: "
          f"{streaming_read_gbps(args.mib, args.repeats):.1f} GB/s")


if __name__ == "__main__":
    main()

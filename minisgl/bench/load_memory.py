"""Peak resident memory while a quantized Hugging Face checkpoint loads, per rank: a random
Llama (the bundled model's tokenizer and vocabulary, hidden 2048, 16 / 4 heads, `--layers`
layers: ~0.6B parameters at 12) written in `--method`'s layout (tests/hf_quant_writers.py),
then served with each `--tp` size in a fresh process.

    python -m minisgl.bench load-memory --method awq --tp 1 2 3
    python -m minisgl.bench load-memory --gguf <a GGUF file> --tp 1   # its blocks, as served

Prints, per tensor-parallel size, the peak RSS of rank 0's process and of the largest worker
beside the checkpoint's size on disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128)


def random_llama(folder: Path, layers: int) -> None:
    from minisgl.models import resolve_model_path
    source = resolve_model_path(None)
    config = {**json.loads((source / "config.json").read_text()), **SHAPE,
              "num_hidden_layers": layers}
    hidden, inter, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 4 * 128
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hidden, hidden),
                       p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden),
                       p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else
                      torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for file in source.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, folder / file.name)


def peak_mb(pid: int | str = "self") -> float:
    """The process's peak RSS (VmHWM: of its own memory image, so not the parent's it was
    forked from, which getrusage's ru_maxrss would report)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_once(folder: str, tp: int) -> None:
    from minisgl import LLM
    with LLM(model=folder, tp_size=tp, max_total_tokens=1024, max_running_requests=2) as llm:
        llm.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        children = [int(pid) for task in Path("/proc/self/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        workers = max([peak_mb(pid) for pid in children], default=0.0)
        print(json.dumps({"rank0_mb": peak_mb(), "worker_mb": workers}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="awq",
                        choices=["awq", "gptq", "compressed-tensors", "fp8"])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gguf", type=Path, default=None,
                        help="load this GGUF file (the default --quantization gguf) instead")
    parser.add_argument("--load-once", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_once:
        load_once(args.load_once[0], int(args.load_once[1]))
        return
    if args.gguf is not None:
        print(f"{args.gguf.name}: {args.gguf.stat().st_size / 1e6:.0f} MB")
        print_peaks(args.gguf, args.tp)
        return
    from tests.hf_quant_writers import write_quantized
    work = Path(tempfile.mkdtemp(prefix="load-memory-"))
    try:
        random_llama(work / "dense-source", args.layers)
        quantized = work / "quantized"
        write_quantized(work / "dense-source", quantized, work / "dense", args.method,
                        args.group, False)
        size = sum(f.stat().st_size for f in quantized.glob("*.safetensors")) / 1e6
        print(f"{args.method} g{args.group}, {args.layers} layers: checkpoint {size:.0f} MB")
        print_peaks(quantized, args.tp)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_peaks(model: Path, tp_sizes: list[int]) -> None:
    print("| tp | rank 0 peak RSS MB | largest worker peak RSS MB |\n|---|---|---|")
    for tp in tp_sizes:
        done = subprocess.run([sys.executable, "-m", "minisgl.bench", "load-memory",
                               "--load-once", str(model), str(tp)],
                              capture_output=True, text=True, check=True)
        peaks = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {tp} | {peaks['rank0_mb']:.0f} | "
              f"{peaks['worker_mb']:.0f} |" if tp > 1 else
              f"| {tp} | {peaks['rank0_mb']:.0f} | |", flush=True)


if __name__ == "__main__":
    main()

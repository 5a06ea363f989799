"""A transformers model written to a GGUF file by llama.cpp's own tools: its
`convert_hf_to_gguf.py`, then `llama-quantize` (both from the tree `make bench` builds into
~/.cache/minisgl/llama.cpp), with the bundled SmolLM2 tokenizer (llama-server needs one). The
scripts that make a random model of a real shape for side-by-side runs share it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl.models.weights import bundled_gguf  # noqa: E402

LLAMA_CPP = Path.home() / ".cache" / "minisgl" / "llama.cpp"


def write_with_llama_cpp(model: torch.nn.Module, out: Path, quant_type: str,
                         edit_config: Callable[[dict], None] | None = None,
                         convert_flags: tuple[str, ...] = ()) -> None:
    """`model` saved in bfloat16, converted, quantized to `quant_type` at `out`. `edit_config`
    changes the saved config.json where the converter reads a key the Hub's config has and
    transformers' does not."""
    with tempfile.TemporaryDirectory() as folder:
        hf = Path(folder) / "hf"
        model.to(torch.bfloat16).save_pretrained(hf)
        if edit_config is not None:
            config = json.loads((hf / "config.json").read_text())
            edit_config(config)
            (hf / "config.json").write_text(json.dumps(config))
        gguf = bundled_gguf()
        transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name
                                                   ).save_pretrained(hf)
        dense = Path(folder) / "bf16.gguf"
        src = LLAMA_CPP / "src"
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outfile",
                        str(dense), "--outtype", "bf16", *convert_flags], check=True,
                       env={**os.environ, "PYTHONPATH": str(src / "gguf-py")})
        quantize(dense, out, quant_type)


def quantize(source: Path, out: Path, quant_type: str) -> None:
    subprocess.run([str(LLAMA_CPP / "build/bin/llama-quantize"), str(source), str(out),
                    quant_type], check=True)

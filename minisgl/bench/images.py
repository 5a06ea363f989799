"""One image's cost, minisgl beside llama.cpp's `llama-server --mmproj` on the same weights:
time to first token of a chat request with one image of each size (a new image every time,
so no cache serves it), less that of the same request without the image; and the vision
encoder alone per image in this process (minisgl's, in bfloat16) beside the encode time
llama-server logs. Rounds alternate the servers.

    python scripts/vision_files.py --out /tmp/qwen-vl --python PYTHON
    python -m minisgl.bench images --model /tmp/qwen-vl/hf \\
        --gguf /tmp/qwen-vl/text-bf16.gguf --mmproj /tmp/qwen-vl/mmproj-bf16.gguf
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from minisgl.bench.compare import (ServerProcess, build_llama_server, log, start_llama,
                                   start_minisgl)

QUESTION = "Describe the image in one word."
# llama-server -v: each line stamped minutes.seconds.ms.us
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
TASK = re.compile(r"\| task (\d+) \|")


def image_png(width: int, height: int, seed: int) -> bytes:
    """A smooth random picture (a noise field blurred by upsampling), as PNG."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3),
                                         dtype=np.uint8))
    out = io.BytesIO()
    small.resize((width, height), Image.BICUBIC).save(out, format="PNG")
    return out.getvalue()


def first_token_seconds(server: ServerProcess, png: bytes | None) -> float:
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if png is not None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = json.dumps({"model": "m", "max_tokens": 1, "temperature": 0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - started


def stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return None if m is None else (int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3
                                   + int(m[4]) / 1e6)


def llama_encode_seconds(lines: list[str]) -> list[float]:
    """Per request (llama-server's task) with images, in order, the seconds its encoder took
    (-v log): each batch's "encoding batch" to its "output embedding", summed over the
    image's slices (SmolVLM's tiles are encoded one at a time)."""
    per_task: dict[int, float] = {}
    task, start = None, None
    for line in lines:
        found = TASK.search(line)
        if "process_mtmd" in line and found:
            task = int(found[1])
            per_task.setdefault(task, 0.0)
        elif "mtmd_batch_encode_impl: encoding batch" in line:
            start = stamp(line)
        elif ("clip_encode: output embedding" in line and start is not None
              and task is not None):
            per_task[task] += stamp(line) - start
            start = None
    return list(per_task.values())


def encoder_seconds(model: Path, sizes: list[tuple[int, int]], repeats: int
                    ) -> dict[tuple[int, int], tuple[int, float]]:
    """Per size: (image tokens, median seconds of minisgl's encoder on its units), the model
    loaded by an Engine as the server loads it (bfloat16), on this thread."""
    from PIL import Image

    from minisgl.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model_path=str(model), max_total_tokens=1024,
                                 max_running_requests=2))
    try:
        out = {}
        for width, height in sizes:
            units = engine.image_processor.process(Image.open(io.BytesIO(image_png(width,
                                                                                 height, 0))))
            times = []
            with torch.inference_mode():
                for _ in range(repeats):
                    started = time.perf_counter()
                    engine.model.encode_images([u.pixels for u in units], [u.grid for u in units])
                    times.append(time.perf_counter() - started)
            out[(width, height)] = (sum(u.tokens for u in units), statistics.median(times))
        return out
    finally:
        engine.shutdown()


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the HF checkpoint (minisgl)")
    parser.add_argument("--gguf", type=Path, required=True, help="its text model (llama.cpp)")
    parser.add_argument("--mmproj", type=Path, required=True, help="its vision tower (llama.cpp)")
    parser.add_argument("--sizes", nargs="+", default=["448x448", "896x672"],
                        help="WIDTHxHEIGHT of the images")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-server", type=Path, help="use this binary instead of building")
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes]
    llama, why = (args.llama_server, "") if args.llama_server else build_llama_server()
    if llama is None:
        raise SystemExit(why)
    servers = {"minisgl": lambda: start_minisgl(True, 4, 16384, ("--model", str(args.model))),
               "llama.cpp": lambda: start_llama(llama, args.gguf, 1, 16384,
                                                ("--mmproj", str(args.mmproj), "-v"))}
    first: dict[str, dict[object, list[float]]] = {name: {} for name in servers}
    llama_encoded: dict[object, list[float]] = {}
    seed = 1
    for round_ in range(args.rounds):
        for name, start in servers.items():
            server = start()
            try:
                first_token_seconds(server, image_png(64, 64, 0))  # warm up
                for size in [None, *sizes]:
                    png = None if size is None else image_png(*size, seed)
                    seed += 1
                    first[name].setdefault(size, []).append(first_token_seconds(server, png))
                if name == "llama.cpp":  # NOTE: after the warm-up's, one per size
                    for size, seconds in zip(sizes, llama_encode_seconds(server.lines)[1:]):
                        llama_encoded.setdefault(size, []).append(seconds)
            finally:
                server.stop()
            log(f"round {round_ + 1}: {name} done")
    encoder = encoder_seconds(args.model, sizes, args.rounds)
    rows = ["| image | tokens | minisgl first token (s) | llama.cpp first token (s) | "
            "minisgl image cost (s) | llama.cpp image cost (s) | llama.cpp / minisgl |",
            "|---|---|---|---|---|---|---|"]
    result: dict = {"sizes": {}}
    for size in sizes:
        med = {name: statistics.median(first[name][size]) for name in servers}
        base = {name: statistics.median(first[name][None]) for name in servers}
        cost = {name: med[name] - base[name] for name in servers}
        tokens = encoder[size][0]
        rows.append(f"| {size[0]}x{size[1]} | {tokens} | {med['minisgl']:.2f} | "
                    f"{med['llama.cpp']:.2f} | {cost['minisgl']:.2f} | {cost['llama.cpp']:.2f} "
                    f"| {med['llama.cpp'] / med['minisgl']:.2f}x |")
        result["sizes"][f"{size[0]}x{size[1]}"] = {"tokens": tokens, "first_token": med,
                                                   "image_cost": cost,
                                                   "encoder_s": encoder[size][1]}
    rows.append("")
    rows.append("| image | minisgl encoder (s) | llama.cpp encoder (s) | llama.cpp / minisgl |")
    rows.append("|---|---|---|---|")
    for size in sizes:
        ours = encoder[size][1]
        theirs = statistics.median(llama_encoded[size]) if size in llama_encoded else None
        result["sizes"][f"{size[0]}x{size[1]}"]["llama_encoder_s"] = theirs
        rows.append(f"| {size[0]}x{size[1]} | {ours:.2f} | "
                    + ("- | - |" if theirs is None else f"{theirs:.2f} | {theirs / ours:.2f}x |"))
    print("\n".join(rows))
    return result


if __name__ == "__main__":
    main()

"""Does watching cost anything? Output tok/s at 64 streams and /health latency while saturated,
with the /dashboard page closed and open (a real headless Chromium polling it, run at a lower
CPU priority, as a browser on another machine would cost this one nothing), in alternating
rounds against one server.

    python -m minisgl.bench dashboard --rounds 2 --screenshot docs/dashboard.png
    python -m minisgl.bench dashboard --url http://127.0.0.1:PORT --modes closed  # any server
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

from minisgl.bench import serving
from minisgl.bench.browser import Browser, chromium_path
from minisgl.bench.compare import start_minisgl

REPO = Path(__file__).resolve().parents[2]


EVERY_PLOT_HAS_DATA = ("[...document.querySelectorAll('#charts canvas')]"
                       ".every(c => Number(c.dataset.points) > 0)")


def _client(url: str, args: argparse.Namespace) -> argparse.Namespace:
    return serving.sglang_client(
        url, "--probe-health",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.streams),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len))


async def one_round(url: str, args: argparse.Namespace, open_page: bool,
                    screenshot: Path | None) -> dict[str, Any]:
    if not open_page:
        return await serving.run(_client(url, args))
    async with Browser(chromium_path() or "chromium", nice=args.browser_nice) as browser:
        page = await browser.page()
        await page.set_viewport(1280, 1000)
        await page.send("Page.navigate", url=url + "/dashboard")
        result = await serving.run(_client(url, args))
        await page.wait_for(EVERY_PLOT_HAS_DATA, 30, "every plot to receive data")
        if screenshot is not None:
            await page.screenshot(screenshot)
        if page.errors():
            raise RuntimeError(f"the page logged errors: {page.errors()}")
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--server-args", default="", help="extra flags for the started server")
    parser.add_argument("--modes", nargs="+", default=["closed", "open"],
                        choices=["closed", "open"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--browser-nice", type=int, default=10)
    parser.add_argument("--screenshot", type=Path, help="save the page after the last round")
    args = parser.parse_args()
    server = None if args.url else start_minisgl(True, args.streams, 200_000,
                                                 tuple(args.server_args.split()))
    url = args.url or server.url
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    try:
        # NOTE: a whole round first, discarded: the first 64-row batches pay one-time costs
        asyncio.run(serving.run(_client(url, args)))
        for r in range(args.rounds):
            for mode in args.modes:
                last = r == args.rounds - 1 and mode == "open"
                result = asyncio.run(one_round(url, args, mode == "open",
                                               args.screenshot if last else None))
                assert result["failed"] == 0, result["errors"]
                results[mode].append(result)
                print(f"round {r + 1} {mode}: {result['output_tok_s']:.0f} tok/s, /health p50 "
                      f"{result['health_ms']['median']:.1f} ms p99 "
                      f"{result['health_ms']['p99']:.1f} ms", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    print(f"\n{args.streams} streams, {args.num_prompts} prompts of {args.input_len} in / "
          f"{args.output_len} out, {args.rounds} alternating rounds\n")
    print("| dashboard | output tok/s (per round) | TPOT p50 ms | /health p50 ms | "
          "/health p99 ms |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        tok_s = " / ".join(f"{x['output_tok_s']:.0f}" for x in runs)
        tpot = statistics.median(x["tpot_ms"]["median"] for x in runs)
        p50 = " / ".join(f"{x['health_ms']['median']:.1f}" for x in runs)
        p99 = " / ".join(f"{x['health_ms']['p99']:.1f}" for x in runs)
        print(f"| {mode} | {tok_s} | {tpot:.1f} | {p50} | {p99} |")


if __name__ == "__main__":
    main()

"""The one benchmark tool: every benchmark module is a subcommand of `python -m minisgl.bench`,
each one parses its options, a run writes JSON with its tables beside the command that made
them, and every command BENCHMARKS.md shows runs through the tool."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl.bench import SUBCOMMANDS, find
from minisgl.bench.__main__ import main as bench_main
from minisgl.bench.__main__ import markdown_tables

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "minisgl" / "bench"


def command_modules() -> set[str]:
    """The modules of minisgl/bench that are commands: those defining `main`."""
    found = set()
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text())
        if path.stem != "__main__" and any(isinstance(node, ast.FunctionDef)
                                           and node.name == "main" for node in tree.body):
            found.add(path.stem)
    return found


def test_every_benchmark_module_is_a_subcommand():
    assert {s.module for s in SUBCOMMANDS} == command_modules()
    assert len({s.name for s in SUBCOMMANDS}) == len(SUBCOMMANDS)
    assert find("decode_step") is find("decode-step") is not None


@pytest.mark.parametrize("name", [s.name for s in SUBCOMMANDS])
def test_each_subcommand_parses_its_options(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main([name, "--help"])
    assert exit_.value.code == 0
    assert f"python -m minisgl.bench {name}" in capsys.readouterr().out


def test_unknown_subcommand_lists_the_others(capsys):
    assert bench_main(["no-such-benchmark"]) == 2
    assert "decode-step" in capsys.readouterr().err


def test_a_run_writes_its_tables_as_json(tmp_path):
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "minisgl.bench", "--json", str(out),
                           "stream-chunk", "--tokens", "16", "--repeats", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "command: python -m minisgl.bench stream-chunk --tokens 16" in done.stderr
    record = json.loads(out.read_text())
    assert record["command"] == "python -m minisgl.bench stream-chunk --tokens 16 --repeats 1"
    assert record["commit"] and record["machine"]
    table = record["tables"][0]
    assert table["columns"][0] == "workload" and len(table["rows"]) == 3
    assert all(len(row) == len(table["columns"]) for row in table["rows"])


def test_markdown_tables_are_read_as_printed():
    text = "intro\n| a | b |\n|---|---:|\n| 1 | 2.5 |\n| 3 | x |\nafter\n"
    assert markdown_tables(text) == [{"columns": ["a", "b"], "rows": [["1", "2.5"], ["3", "x"]]}]


def test_benchmarks_md_commands_run_through_the_tool():
    """Every benchmark command BENCHMARKS.md and the docs give names a subcommand of the tool,
    and none runs a script of its own."""
    text = "\n".join(p.read_text() for p in [REPO / "BENCHMARKS.md", REPO / "README.md",
                                             *sorted((REPO / "docs").glob("*.md"))])
    names = re.findall(r"python -m minisgl\.bench\s+(?:--json \S+\s+)?([a-z][a-z0-9-]*)", text)
    assert names, "BENCHMARKS.md shows no command"
    unknown = sorted({n for n in names if find(n) is None})
    assert not unknown, f"not subcommands of python -m minisgl.bench: {unknown}"
    assert not re.search(r"scripts/(bench_|compare|profile_)", text)


def test_the_bandwidth_probe_reads_every_byte():
    """bench.bandwidth's kernel read (stream_read) touches each 8-byte word of the buffer: its
    result is their xor, whichever thread read which share."""
    import numpy as np
    import torch

    from minisgl.bench.bandwidth import streaming_read_gbps
    from minisgl.kernels.cpu import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("needs the CPU kernels")
    words = torch.randint(-2**62, 2**62, (3 * 2**16 + 32,), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(0))
    assert kernels.stream_read(words) == int(np.bitwise_xor.reduce(words.numpy()))
    with pytest.raises(RuntimeError, match="256-byte"):
        kernels.stream_read(words[:5])
    assert streaming_read_gbps(mib=4, repeats=2) > 0

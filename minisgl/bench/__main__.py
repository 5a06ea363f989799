"""python -m minisgl.bench [--json PATH] NAME [ARGS]: see minisgl/bench/__init__.py."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from minisgl.bench import SUBCOMMANDS, find

KINDS = {"serving": "servers side by side", "offline": "LLM.generate in process",
         "kernel": "one part alone, no scheduler", "gpu": "CUDA only"}


def usage() -> str:
    lines = [__doc__.split(":")[0], ""]
    for kind, meaning in KINDS.items():
        lines.append(f"{kind} ({meaning}):")
        lines += [f"  {s.name:<16} {s.summary}" for s in SUBCOMMANDS if s.kind == kind]
    lines.append("\n`python -m minisgl.bench NAME --help` gives each one's options.")
    return "\n".join(lines)


def provenance(command: str) -> dict[str, Any]:
    """What a result needs beside it to be reproduced: the command, the commit, the machine."""
    repo = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return {"command": command, "commit": commit + ("+dirty" if dirty else ""),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "python": platform.python_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


class Tee(io.TextIOBase):
    """Stdout that also keeps what was written (the tables a run prints)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def markdown_tables(text: str) -> list[dict[str, Any]]:
    """The Markdown tables in a run's output, as {columns, rows} (cells as printed)."""
    tables, lines = [], text.splitlines()
    for i in range(len(lines) - 1):
        header, rule = lines[i].strip(), lines[i + 1].strip()
        if not (header.startswith("|") and rule.startswith("|---")):
            continue
        def cells(line: str) -> list[str]:
            return [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows = []
        for line in lines[i + 2:]:
            if not line.strip().startswith("|"):
                break
            rows.append(cells(line))
        tables.append({"columns": cells(header), "rows": rows})
    return tables


def main(argv: list[str]) -> int:
    json_path = None
    if argv[:1] == ["--json"] and len(argv) > 1:
        json_path, argv = Path(argv[1]), argv[2:]
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    sub = find(argv[0])
    if sub is None:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "minisgl.bench", sub.name, *argv[1:]])
    print(f"command: {command}", file=sys.stderr, flush=True)
    record = provenance(command)
    module = importlib.import_module(f"minisgl.bench.{sub.module}")
    saved, sys.argv = sys.argv, [f"python -m minisgl.bench {sub.name}", *argv[1:]]
    tee = Tee(sys.stdout)
    try:  # NOTE: each module's argparse reads sys.argv
        with contextlib.redirect_stdout(tee):
            results = module.main()
    finally:
        sys.argv = saved
    if json_path is not None:
        printed = tee.kept.getvalue()
        record.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"), results=results,
                      tables=markdown_tables(printed), output=printed)
        json_path.write_text(json.dumps(record, indent=1, default=str))
        print(f"written to {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

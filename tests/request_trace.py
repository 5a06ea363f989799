"""`python tests/request_trace.py serve ...`: `python -m minisgl serve ...` under a profile hook
that records which minisgl files a request's handling enters and which file called which
(SIGUSR1 starts recording, SIGUSR2 writes {"calls": {file: calls}, "edges": [[caller, callee,
calls], ...]} as JSON to $MINISGL_TRACE_OUT; an edge is a direct call between two minisgl
files, not one the event loop or a thread dispatched).

Counted: calls into minisgl files outside the model's forward (models/, layers/, attention/,
kernels/, and whatever they call: a call with one of those on its stack is the forward's).
Not counted: the dashboard's once-a-second sampler (server/timeline.py and what it reads),
which runs whether or not a request does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[1] / "minisgl") + os.sep
MODEL_FORWARD = tuple(PACKAGE + d + os.sep for d in ("models", "layers", "attention", "kernels"))
SAMPLER = PACKAGE + os.path.join("server", "timeline.py")


def _outside(frame: FrameType | None) -> bool:
    """Whether no frame of this stack is the model's forward or the dashboard's sampler."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(MODEL_FORWARD) or name == SAMPLER:
            return False
        frame = frame.f_back
    return True


class Recorder:
    def __init__(self, out: str) -> None:
        self.out, self.on = out, False
        self.calls: Counter[str] = Counter()
        self.edges: Counter[tuple[str, str]] = Counter()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(PACKAGE) and _outside(frame):
                callee = name[len(PACKAGE):]
                self.calls[callee] += 1
                caller = frame.f_back.f_code.co_filename if frame.f_back else ""
                if caller.startswith(PACKAGE) and caller[len(PACKAGE):] != callee:
                    self.edges[caller[len(PACKAGE):], callee] += 1

    def start(self, *_: Any) -> None:
        self.calls.clear()
        self.edges.clear()
        self.on = True

    def stop(self, *_: Any) -> None:
        self.on = False
        Path(self.out).write_text(json.dumps({
            "calls": dict(self.calls),
            "edges": [[a, b, n] for (a, b), n in sorted(self.edges.items())]}))


def main() -> int:
    recorder = Recorder(os.environ["MINISGL_TRACE_OUT"])
    signal.signal(signal.SIGUSR1, recorder.start)
    signal.signal(signal.SIGUSR2, recorder.stop)
    sys.setprofile(recorder.hook)
    threading.setprofile(recorder.hook)  # NOTE: the engine thread starts later
    from minisgl.__main__ import main as minisgl_main
    sys.argv = ["minisgl", *sys.argv[1:]]
    return minisgl_main()


if __name__ == "__main__":
    sys.exit(main())

"""The soak tool end to end, shortened: it starts its own server (LoRA, priorities and NGRAM
speculation at once, a pool small enough to retract), drives every kind of request for
half a minute on a two-layer model, and its verdict must hold. The hour on the bundled model
is a documented command (BENCHMARKS.md, "Soak"), not part of the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from minisgl.bench.soak import MIX
from tests.test_hardening import SHALLOW

pytestmark = pytest.mark.slow


def test_a_short_soak_passes_every_check(tmp_path: Path):
    cmd = [sys.executable, "-m", "minisgl.bench", "soak", "--minutes", "0.5", "--interval", "2.5",
           "--max-total-tokens", "1500", "--dtype", "float32", "--out", str(tmp_path),
           # float32: a greedy probe may leave its solo run only where the reference's top
           # two logprobs are within 1e-2 (tests/reference.py's bound)
           "--margin-bound", "0.01",
           # half a minute is shorter than the default admission's decay to its optimistic
           # floor (600 decode steps): start below it, so the small pool must retract
           "--server-args", " ".join(SHALLOW[:3]) + f" '{SHALLOW[3]}'"
           + " --schedule-conservativeness 0.1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "verdict: PASS" in run.stdout
    results = json.loads((tmp_path / "series.json").read_text())
    assert results["passed"]
    failed = [c for c in results["checks"] if not c["pass"]]
    assert not failed, failed
    # every kind ran, and the mix was dealt in its proportions (a whole deck at a time)
    sent = {row["kind"]: row["sent"] for row in results["kinds"]}
    assert set(sent) == set(MIX) and all(sent.values()), sent
    assert all(row["ok"] + row["aborted"] == row["sent"] for row in results["kinds"])
    for kind in ("hang-up", "abort"):
        assert next(r for r in results["kinds"] if r["kind"] == kind)["aborted"] >= 1
    samples = results["samples"]
    assert len(samples) >= 6 and max(s["kv_used_tokens"] for s in samples) > 0
    assert results["end_state"]["kv_used_tokens"] == 0
    with Image.open(tmp_path / "soak.png") as image:
        assert image.format == "PNG" and image.height >= 5 * 100

"""SGLang's own benchmark client, unmodified (`python -m sglang.bench_serving`, sglang 0.5.23),
against a real minisgl server, for its three backends: the native `/generate` stream and the
two OpenAI endpoints. It runs from its own virtualenv (`make test` builds `.venv-sglang`): it
imports torchvision, which needs a torch build other than ours."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.test_server import get

CLIENT = Path(os.environ.get("MINISGL_SGLANG_PYTHON", REPO_ROOT / ".venv-sglang/bin/python"))
PROMPTS = 8


@pytest.mark.skipif(not CLIENT.exists(), reason="no SGLang client venv: run `make test`")
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_completes_every_request(minisgl_server, backend, tmp_path):
    tokenizer = get(minisgl_server, "/get_model_info").json()["tokenizer_path"]
    result = tmp_path / "result.jsonl"
    done = subprocess.run(
        [str(CLIENT), "-m", "sglang.bench_serving", "--backend", backend,
         "--base-url", minisgl_server.url, "--dataset-name", "random-ids",
         "--random-input-len", "32", "--random-output-len", "8",
         "--num-prompts", str(PROMPTS), "--max-concurrency", "4", "--tokenizer", tokenizer,
         "--output-file", str(result)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(result.read_text().splitlines()[-1])
    assert summary["completed"] == PROMPTS, summary
    assert summary["total_output_tokens"] >= PROMPTS

"""Observability on a real server: /metrics under SGLang's names (parsed by prometheus_client),
--log-requests lines, the /dashboard page in a real headless Chromium, and the start-up
progress lines. The model is the bundled one cut to 2 layers with random weights: these tests
check the protocol and the page, not numerics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from minisgl.kernels.cpu import build_folder, cpu_kernels
from minisgl.runtime.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from minisgl.bench.browser import Browser, chromium_path
from tests.conftest import REPO_ROOT, start_minisgl_server
from tests.test_server import wait_for
from tests.test_hardening import SHALLOW

SERVER_ARGS = SHALLOW  # the module's server checks protocol, not numerics

KEY = "observability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMALL_MODEL = ("--load-format", "dummy", "--json-model-override-args",
               '{"num_hidden_layers": 2}')
ARTIFACTS = Path(os.environ.get("MINISGL_TEST_ARTIFACTS", REPO_ROOT / "build" / "test-artifacts"))
MARKER = "zebra-quartz-marker"  # a prompt text no log line may carry at level 0

# SGLang's names and types (its production-metrics page and metrics collector)
SGLANG_FAMILIES = {
    "sglang:num_running_reqs": "gauge", "sglang:num_queue_reqs": "gauge",
    "sglang:num_used_tokens": "gauge", "sglang:token_usage": "gauge",
    "sglang:gen_throughput": "gauge", "sglang:cache_hit_rate": "gauge",
    "sglang:kv_used_tokens": "gauge", "sglang:kv_available_tokens": "gauge",
    "sglang:kv_evictable_tokens": "gauge", "sglang:max_total_num_tokens": "gauge",
    "sglang:prompt_tokens": "counter", "sglang:generation_tokens": "counter",
    "sglang:cached_tokens": "counter", "sglang:num_requests": "counter",
    "sglang:num_aborted_requests": "counter", "sglang:num_retracted_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:time_per_output_token_seconds": "histogram",
    "sglang:request_time_per_output_token_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:prompt_tokens_histogram": "histogram",
    "sglang:generation_tokens_histogram": "histogram",
}
BUCKETS = {"sglang:time_to_first_token_seconds": TTFT_BUCKETS,
           "sglang:inter_token_latency_seconds": ITL_BUCKETS,
           "sglang:e2e_request_latency_seconds": E2E_BUCKETS}
# the series SGLang's own Grafana dashboard (examples/monitoring) queries
SGLANG_DASHBOARD_SERIES = ("sglang:e2e_request_latency_seconds_bucket",
                           "sglang:e2e_request_latency_seconds_sum",
                           "sglang:e2e_request_latency_seconds_count",
                           "sglang:time_to_first_token_seconds_bucket",
                           "sglang:time_to_first_token_seconds_sum",
                           "sglang:time_to_first_token_seconds_count",
                           "sglang:num_running_reqs", "sglang:gen_throughput",
                           "sglang:cache_hit_rate", "sglang:num_queue_reqs")
GRAFANA = REPO_ROOT / "scripts" / "grafana" / "minisgl-dashboard.json"
# SGLang's default TTFT edges, written out here so that a change to ours fails
SGLANG_TTFT_EDGES = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)


@pytest.fixture(scope="module")
def observed():
    server = start_minisgl_server(*SMALL_MODEL, "--api-key", KEY, "--log-requests",
                                  "--log-requests-format", "json")
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()


def generate(server: Any, body: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    response = requests.post(server.url + "/generate", json={**body, "stream": stream},
                             headers=AUTH, timeout=120, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    last = None
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            last = json.loads(line[len(b"data: "):])
    return last


def scrape(server: Any) -> tuple[dict[str, Any], dict[tuple[str, frozenset], float]]:
    """/metrics parsed by prometheus_client: families by name, and each sample's value keyed
    by (sample name, its labels)."""
    response = requests.get(server.url + "/metrics", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    values = {(s.name, frozenset(s.labels.items())): s.value
              for f in families.values() for s in f.samples}
    return families, values


def value(values: dict, name: str, **labels: str) -> float:
    return values.get((name, frozenset({"model_name": "SmolLM2-135M-Instruct", **labels}
                                       .items())), 0.0)


def test_metrics_carry_sglang_names_types_labels_and_buckets(observed):
    families, _ = scrape(observed)
    for name, kind in SGLANG_FAMILIES.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["model_name"] == "SmolLM2-135M-Instruct", sample
    assert "minisgl_engine_decode_seconds" in families  # our own engine series stay beside
    assert TTFT_BUCKETS == SGLANG_TTFT_EDGES
    for name, edges in BUCKETS.items():
        les = {s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")}
        assert les == {*(str(float(e)) for e in edges), "+Inf"}, name


def test_grafana_dashboards_query_only_series_we_serve(observed):
    """Ours (generated by scripts/grafana_dashboard.py, and up to date) and SGLang's own."""
    generator = subprocess.run([sys.executable, "scripts/grafana_dashboard.py", "--check"],
                               cwd=REPO_ROOT, timeout=60)
    assert generator.returncode == 0, "rerun scripts/grafana_dashboard.py"
    generate(observed, {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    _, values = scrape(observed)
    served = {name for name, _ in values}
    exprs = [t["expr"] for p in json.loads(GRAFANA.read_text())["panels"] for t in p["targets"]]
    queried = set(re.findall(r"(?:sglang:|minisgl_)[a-z0-9_]+", " ".join(exprs)))
    assert len(queried) >= 15 and queried <= served, queried - served
    assert set(SGLANG_DASHBOARD_SERIES) <= served, set(SGLANG_DASHBOARD_SERIES) - served


def test_metrics_move_as_requests_run(observed):
    _, before = scrape(observed)
    done: dict[str, Any] = {}
    long = threading.Thread(target=lambda: done.update(generate(observed, {
        "text": "Count slowly:", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True,
                                                     "temperature": 0}}, stream=True)))
    long.start()
    _, running = wait_for(lambda: (lambda m: m if value(m[1], "sglang:gen_throughput") > 0
                                   else None)(scrape(observed)), timeout=60,
                          what="gen_throughput above 0 while a request runs")
    assert value(running, "sglang:num_running_reqs") >= 1
    assert value(running, "sglang:num_used_tokens") > 0
    assert value(running, "sglang:token_usage") > 0
    assert (value(running, "sglang:generation_tokens_total", is_streaming="true")
            > value(before, "sglang:generation_tokens_total", is_streaming="true"))
    long.join(120)
    shared = "word " * 80  # whole pages of a shared prefix: the later prompts hit the cache
    params = {"max_new_tokens": 12, "ignore_eos": True}
    first = generate(observed, {"text": shared + "zero", "sampling_params": params})
    batch = generate(observed, {"text": [shared + "one", shared + "two"],
                                "sampling_params": params})
    _, after = scrape(observed)
    metas = [first["meta_info"], *(r["meta_info"] for r in batch)]
    streamed = done["meta_info"]

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("sglang:num_requests_total", is_streaming="false") == 3
    assert grew("sglang:num_requests_total", is_streaming="true") == 1
    assert grew("sglang:prompt_tokens_total", is_streaming="false") == sum(
        m["prompt_tokens"] for m in metas)
    assert grew("sglang:generation_tokens_total", is_streaming="false") == sum(
        m["completion_tokens"] for m in metas)
    assert grew("sglang:generation_tokens_total", is_streaming="true") == streamed[
        "completion_tokens"] == 1500
    cached = sum(m["cached_tokens"] for m in metas)
    assert cached > 0 and grew("sglang:cached_tokens_total", cache_source="device") == cached
    for name, mode in (("time_to_first_token", "false"), ("e2e_request_latency", "false")):
        assert grew(f"sglang:{name}_seconds_count", is_streaming=mode) == 3
        assert grew(f"sglang:{name}_seconds_sum", is_streaming=mode) > 0
    assert grew("sglang:inter_token_latency_seconds_count") == sum(
        m["completion_tokens"] - 1 for m in [*metas, streamed])
    assert grew("sglang:time_per_output_token_seconds_count", is_streaming="true") == 1
    assert value(after, "sglang:cache_hit_rate") > 0
    assert value(after, "sglang:num_running_reqs") == 0


def log_records(server: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in list(server.stdout) if line.startswith("{")]


def test_request_log_has_one_json_line_per_request_and_no_text(observed):
    bodies = [{"text": f"{MARKER} {i}", "rid": f"log-{i}",
               "sampling_params": {"max_new_tokens": 5 + i, "ignore_eos": True}}
              for i in range(3)]
    metas = {b["rid"]: generate(observed, b, stream=i == 0)["meta_info"]
             for i, b in enumerate(bodies)}
    aborted = threading.Thread(target=generate, args=(observed, {
        "text": MARKER, "rid": "log-abort", "sampling_params": {"max_new_tokens": 8000,
                                                                "ignore_eos": True}}))
    aborted.start()
    wait_for(lambda: requests.get(observed.url + "/get_server_info", headers=AUTH, timeout=30)
             .json()["internal_states"][0]["num_running_reqs"] > 0, what="a running request")
    requests.post(observed.url + "/abort_request", json={"rid": "log-abort"}, headers=AUTH,
                  timeout=30)
    aborted.join(60)
    rids = [*metas, "log-abort"]
    records = wait_for(lambda: (lambda rs: rs if set(rids) <= set(rs) else None)(
        {r["rid"]: r for r in log_records(observed) if r["rid"] in rids}), what="log lines")
    assert sorted(r["rid"] for r in log_records(observed) if r["rid"] in rids) == sorted(rids)
    for rid, meta in metas.items():
        record = records[rid]
        assert record["event"] == "request.finished"
        assert record["is_streaming"] == (rid == "log-0")
        for field in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            assert record[field] == meta[field], (field, record, meta)
        assert record["finish_reason"] == meta["finish_reason"]["type"] == "length"
        assert 0 < record["ttft"] <= record["e2e_latency"]
        assert abs(record["e2e_latency"] - meta["e2e_latency"]) < 0.05
        assert not {"prompt", "output", "sampling_params"} & set(record)
    assert records["log-abort"]["finish_reason"] == "abort"
    assert records["log-abort"]["abort_message"] == "aborted by /abort_request"
    assert MARKER not in "".join(observed.stdout) + "".join(observed.stderr)


def test_request_log_levels_add_parameters_then_text(caplog):
    from minisgl import LLM

    with LLM(dtype="float32", load_format="dummy", max_total_tokens=4096,
             json_model_override_args='{"num_hidden_layers": 2}', log_requests=True,
             log_requests_level=2) as llm:
        with caplog.at_level(logging.INFO, logger="minisgl.requests"):
            [out] = llm.generate([MARKER * 200], {"max_new_tokens": 3, "ignore_eos": True,
                                                  "temperature": 0.5})
    [line] = [r.getMessage() for r in caplog.records if r.name == "minisgl.requests"]
    assert line.startswith("finished rid=") and "\n" not in line
    head = line.removeprefix("finished ").split(" sampling_params=")[0]
    fields = dict(part.split("=", 1) for part in head.split(" "))
    assert int(fields["completion_tokens"]) == 3 and fields["finish_reason"] == "length"
    assert '"temperature":0.5' in line  # level 1: the sampling parameters
    prompt = json.loads(line.split(" prompt=", 1)[1].split(" output=", 1)[0])
    assert prompt == (MARKER * 200)[:2048]  # level 2: cut to 2048 characters
    assert json.loads(line.split(" output=", 1)[1]) == out["text"]


def test_dashboard_in_headless_chromium(observed):
    executable = chromium_path()
    if executable is None:
        if os.environ.get("MINISGL_REQUIRE_BROWSER"):
            pytest.fail("chromium is missing (make test installs it with apt-get)")
        pytest.skip("no chromium on this machine")
    stop = threading.Event()

    def load() -> None:  # requests keep running while the page watches
        i = 0
        while not stop.is_set():
            generate(observed, {"text": f"load {i}", "sampling_params": {
                "max_new_tokens": 64, "ignore_eos": True}}, stream=i % 2 == 0)
            i += 1

    device = requests.get(observed.url + "/dashboard/data", headers=AUTH,
                          timeout=30).json()["server"].get("device")
    workers = [threading.Thread(target=load) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        asyncio.run(watch_dashboard(executable, observed.url, device))
    finally:
        stop.set()
        for worker in workers:
            worker.join(120)


EVERY_PLOT_HAS_DATA = """(() => {
  const canvases = [...document.querySelectorAll('#charts canvas')];
  const points = Object.fromEntries(canvases.map(c => [c.id, Number(c.dataset.points)]));
  return canvases.length === 7 && Object.values(points).every(n => n > 0) ? points : null;
})()"""
# the y-axis labels (the text drawn right-aligned) of each canvas the code given draws
AXIS_LABELS = """(() => {
  const drawn = {}, fillText = CanvasRenderingContext2D.prototype.fillText;
  CanvasRenderingContext2D.prototype.fillText = function (text, x, y) {
    if (this.textAlign === 'right') (drawn[this.canvas.id] ??= []).push(text);
    return fillText.call(this, text, x, y);
  };
  try { %s; } finally { CanvasRenderingContext2D.prototype.fillText = fillText; }
  return drawn;
})()"""
REQUESTS_0_TO_1 = ("charts.find(c => c.canvas.id === 'chart-requests').draw("
                   "[{t: 0, running: 1, waiting: 0}, {t: 1, running: 0, waiting: 1}], 60, 1)")


async def watch_dashboard(executable: str, url: str, device: str | None) -> None:
    async with Browser(executable) as browser:
        page = await browser.page()
        await page.set_viewport(390, 844, mobile=True)  # a phone
        await page.send("Page.navigate", url=url + "/dashboard")
        await page.wait_for("document.getElementById('key-form')?.classList.contains('shown')",
                            30, "the API key form (the data endpoint answers 401 without it)")
        await page.evaluate(f"document.getElementById('key').value = {json.dumps(KEY)}; "
                            "document.querySelector('#key-form button').click(); true")
        points = await page.wait_for(EVERY_PLOT_HAS_DATA, 60, "every plot to receive data")
        assert points["chart-throughput"] >= 2, points
        assert await page.evaluate("document.getElementById('status').textContent") == "live"
        assert "SmolLM2-135M-Instruct" in await page.evaluate(
            "document.getElementById('model').textContent")
        running = await page.evaluate("document.getElementById('stat-running').textContent")
        assert running.isdigit(), running
        assert await page.evaluate("document.querySelectorAll('#args tr').length") > 30
        # a count gets whole-number ticks, each once (not 0, 0, 1, 1, 1 for 0..1)
        assert (await page.evaluate(AXIS_LABELS % REQUESTS_0_TO_1))["chart-requests"] == ["0", "1"]
        labels = await page.evaluate(AXIS_LABELS % "render()")
        assert len(labels) == 7, labels
        assert all(len(set(ls)) == len(ls) >= 2 for ls in labels.values()), labels
        assert all(label.isdigit() for label in labels["chart-requests"]), labels
        # "CUDA: launch time only" is a note for CUDA servers
        text = await page.evaluate("document.body.innerText")
        assert ("CUDA" in text) == (device == "cuda"), (device, text)
        # no speculative-decoding panel on a server that does not speculate
        assert "Speculative" not in text and "chart-spec" not in labels, text
        # readable on a phone: nothing wider than the screen
        assert await page.evaluate(
            "document.documentElement.scrollWidth <= window.innerWidth"), "horizontal scroll"
        await page.screenshot(ARTIFACTS / "dashboard-phone.png")
        await page.set_viewport(1280, 900)
        await asyncio.sleep(1.5)  # a poll or two at the new width
        await page.screenshot(ARTIFACTS / "dashboard-desktop.png")
        await page.evaluate("true")  # collect the events sent meanwhile
        # the one error expected: the browser logs the 401 that asked for the key
        errors = [e for e in page.errors() if not ("status of 401" in e and
                                                   "/dashboard/data?since=0" in e)]
        assert errors == [], errors
        assert len(page.errors()) == 1, page.errors()


def test_dashboard_page_needs_no_key_but_its_data_does(observed):
    for path in ("/dashboard", "/dashboard.js"):
        assert requests.get(observed.url + path, timeout=30).status_code == 200
    assert requests.get(observed.url + "/dashboard/data", timeout=30).status_code == 401
    assert requests.get(observed.url + "/metrics", timeout=30).status_code == 401
    data = requests.get(observed.url + "/dashboard/data", headers=AUTH, timeout=30).json()
    assert data["server"]["args"]["api_key"] == "<set>"
    assert data["server"]["speculation"] is False  # the page draws no speculation panel
    assert data["samples"] and {"running", "waiting", "kv_requests", "kv_cache", "output_tok_s",
                                "ttft_p99", "itl_p99", "prefill_tok_s", "decode_tok_s",
                                "busy"} <= set(data["samples"][-1])
    later = requests.get(observed.url + f"/dashboard/data?since={data['samples'][-1]['t']}",
                         headers=AUTH, timeout=30).json()
    assert "server" not in later
    assert all(s["t"] > data["samples"][-1]["t"] for s in later["samples"])


def test_start_up_says_what_it_does(observed):
    log = "".join(observed.stderr)
    assert "KV pool:" in log and "loaded in" in log
    assert any(line.startswith("minisgl ready: listening on") for line in observed.stdout)


def test_first_kernel_build_says_so(tmp_path):
    """A cache without the CPU kernels' library builds it: one line before, one after. The
    cache is seeded with this checkout's compiled objects, so ninja only links (the suite
    compiles the kernels once, wherever they are first used)."""
    assert cpu_kernels() is not None  # the warm build, compiled now if no test needed it yet
    warm = build_folder()
    seeded = tmp_path / "kernels" / warm.name
    shutil.copytree(warm, seeded, ignore=shutil.ignore_patterns("*.so", "lock"))
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from minisgl.kernels.cpu import cpu_kernels; assert cpu_kernels() is not None")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MINISGL_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    [before] = [i for i, line in enumerate(lines) if "compiling the CPU kernels" in line]
    [after] = [i for i, line in enumerate(lines) if "CPU kernels compiled in" in line]
    assert before < after, lines
    assert (seeded / "minisgl_cpu_kernels.so").exists()


def test_a_built_library_loads_without_the_build_lock(tmp_path):
    """Where a finished build's library lies, a start imports it without torch's loader, which
    would take the folder's lock (and write its build file) even with nothing to build."""
    assert cpu_kernels() is not None
    warm = build_folder()
    seeded = tmp_path / "kernels" / warm.name
    seeded.mkdir(parents=True)
    shutil.copy(warm / "minisgl_cpu_kernels.so", seeded)
    code = ("import logging; logging.basicConfig(level=logging.INFO); "
            "from minisgl.kernels.cpu import cpu_kernels; assert cpu_kernels() is not None")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MINISGL_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "compiling" not in done.stderr
    assert sorted(p.name for p in seeded.iterdir()) == ["minisgl_cpu_kernels.so"]


@pytest.mark.parametrize("flags", [["--log-requests-level", "5"],
                                   ["--log-requests-format", "xml"],
                                   ["--log-format", "yaml"]])
def test_bad_log_flags_are_one_line(flags):
    done = subprocess.run([sys.executable, "-m", "minisgl", "serve", *flags],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert flags[0] in done.stderr

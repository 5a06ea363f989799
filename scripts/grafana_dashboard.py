"""Writes scripts/grafana/minisgl-dashboard.json: a Grafana dashboard over minisgl's /metrics
(SGLang's `sglang:*` series plus minisgl's engine series), with `datasource`, `instance` and
`model_name` variables. Import it in Grafana (Dashboards > New > Import) after pointing a
Prometheus job at the server's /metrics.

    python scripts/grafana_dashboard.py            # rewrite the JSON
    python scripts/grafana_dashboard.py --check    # exit 1 if the JSON is not what it writes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "grafana" / "minisgl-dashboard.json"
SEL = '{instance=~"$instance", model_name=~"$model_name"}'


def quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{SEL}"
             f"[$__rate_interval])))", f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, [(PromQL, legend)])
PANELS = [
    ("Time to first token", "s", quantiles("sglang:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("sglang:inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("sglang:e2e_request_latency_seconds")),
    ("Requests", "short", [(f"sglang:num_running_reqs{SEL}", "running"),
                           (f"sglang:num_queue_reqs{SEL}", "waiting")]),
    ("Generation throughput", "short", [
        (f"sglang:gen_throughput{SEL}", "tok/s (server's estimate)"),
        (f"sum(rate(sglang:generation_tokens_total{SEL}[$__rate_interval]))", "tok/s (counter)"),
        (f"sum(rate(sglang:prompt_tokens_total{SEL}[$__rate_interval]))", "prompt tok/s")]),
    ("KV cache", "percentunit", [(f"sglang:token_usage{SEL}", "used by requests"),
                                 (f"sglang:kv_evictable_tokens{SEL} / "
                                  f"sglang:max_total_num_tokens{SEL}", "prefix cache"),
                                 (f"sglang:cache_hit_rate{SEL}", "cache hit rate")]),
    ("Engine time by phase (share of wall time)", "percentunit", [
        (f"rate(minisgl_engine_{phase}_seconds_total{SEL}[$__rate_interval])", phase)
        for phase in ("prefill", "decode", "mixed")]),
    ("Tokens forwarded", "short", [
        (f"rate(minisgl_engine_{kind}_tokens_total{SEL}[$__rate_interval])", kind)
        for kind in ("prefill", "decode")]),
    ("Requests finished, aborted, retracted", "short", [
        (f"sum(rate(sglang:num_requests_total{SEL}[$__rate_interval]))", "finished / s"),
        (f"rate(sglang:num_aborted_requests_total{SEL}[$__rate_interval])", "aborted / s"),
        (f"rate(sglang:num_retracted_requests_total{SEL}[$__rate_interval])", "retracted / s"),
        (f"rate(minisgl_preemptions_total{SEL}[$__rate_interval])", "preempted / s")]),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    return {
        "id": index + 1, "type": "timeseries", "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(targets)],
    }


def variable(name: str, query: str) -> dict:
    return {"name": name, "label": name, "type": "query", "query": query, "definition": query,
            "datasource": {"type": "prometheus", "uid": "${datasource}"}, "refresh": 1,
            "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict:
    return {
        "title": "minisgl", "uid": "minisgl", "schemaVersion": 39, "version": 1,
        "editable": True, "refresh": "5s", "time": {"from": "now-30m", "to": "now"},
        "tags": ["minisgl", "sglang"],
        "templating": {"list": [
            {"name": "datasource", "label": "datasource", "type": "datasource",
             "query": "prometheus"},
            variable("instance", "label_values(sglang:num_running_reqs, instance)"),
            variable("model_name", "label_values(sglang:num_running_reqs, model_name)")]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    text = json.dumps(dashboard(), indent=2) + "\n"
    if parser.parse_args().check:
        return 0 if OUT.exists() and OUT.read_text() == text else 1
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

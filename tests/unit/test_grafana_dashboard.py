"""The metrics dashboards read only what the server exports: deploy/grafana/kettle-dashboard.json's PromQL and the
browser dashboard's (kettle/router/static/dashboard.js) metric names, checked against Kettle's own metric
definitions and the sample names /metrics writes for them (TGI's counters without `_total`, Kettle's with it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from kettle.router import metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana" / "kettle-dashboard.json"
PAGE = ROOT / "kettle" / "router" / "static" / "dashboard.js"
NAME = re.compile(r"\b((?:tgi|kettle)_[a-z_]+)\b")
# Labels Prometheus adds to every scraped series, and the histogram's bucket bound.
SCRAPE_LABELS = {"instance", "job", "le"}


def kettle_metrics() -> list[MetricWrapperBase]:
    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def exported_samples(only_unlabelled: bool = False) -> set[str]:
    """Every sample name /metrics can write, whether or not a labelled metric has a child yet."""
    names = []
    for metric in kettle_metrics():
        if only_unlabelled and metric._labelnames:
            continue
        kind, name = metric._type, metric._name
        if kind == "counter":
            names.append(f"{name}_total")
        elif kind == "histogram":
            names += [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
        else:
            names.append(name)
    # Through the server's own renaming (TGI's counters lose `_total`), as render() applies it.
    text = "".join(f"{name} 0\n" for name in names).encode()
    return {line.split()[0] for line in metrics._TOTAL_SUFFIX.sub(rb"\1", text).decode().splitlines()}


def exported_labels() -> set[str]:
    return {label for metric in kettle_metrics() for label in metric._labelnames} | SCRAPE_LABELS


def grafana_expressions() -> list[str]:
    dashboard = json.loads(GRAFANA.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return expressions


def test_exported_samples_match_a_real_scrape():
    """The names above are the ones render() writes: all of them for metrics without labels (those with labels
    write samples only once a child exists), and nothing else."""
    lines = metrics.render().decode().splitlines()
    rendered = {match.group(1) for line in lines if (match := NAME.match(line))}
    assert exported_samples(only_unlabelled=True) <= rendered <= exported_samples()


def test_grafana_dashboard_queries_only_exported_metrics():
    expressions = grafana_expressions()
    assert len(expressions) >= 15
    used = {name for expr in expressions for name in NAME.findall(expr)}
    assert used - exported_samples() == set()
    # Every panel the issue asks for is there: rates, queue, batch, tokens, KV use, latency percentiles, memory.
    for name in (
        "tgi_request_count",
        "tgi_queue_size",
        "tgi_batch_current_size",
        "tgi_request_generated_tokens_sum",
        "kettle_kv_blocks_free",
        "kettle_request_time_to_first_token_bucket",
        "tgi_request_mean_time_per_token_duration_bucket",
        "kettle_process_resident_memory_bytes",
    ):
        assert name in used, name


def test_grafana_dashboard_groups_and_filters_by_labels_that_exist():
    labels = set()
    for expr in grafana_expressions():
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels.update(label.strip() for label in group.split(",") if label.strip())
        for matchers in re.findall(r"\{([^}]*)\}", expr):
            labels.update(re.findall(r"(\w+)\s*=~?", matchers))
        labels.update(re.findall(r"\{\{(\w+)\}\}", expr))
    assert labels - exported_labels() == set()


def test_grafana_dashboard_is_importable_json():
    dashboard = json.loads(GRAFANA.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert all(target["refId"] and target["expr"] for target in panel["targets"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance"}


def test_browser_dashboard_reads_only_exported_metrics():
    """dashboard.js reads samples by name, and histograms by their name plus `_bucket`."""
    samples = exported_samples()
    used = set(NAME.findall(PAGE.read_text()))
    assert len(used) >= 10
    missing = {name for name in used if name not in samples and f"{name}_bucket" not in samples}
    assert missing == set()

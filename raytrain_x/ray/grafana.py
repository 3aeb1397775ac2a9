"""The Grafana dashboard of raytrain-x's metrics (`raytrain-x dashboard`), built from one
list of panels: each names a metric of `metrics.METRICS` and how to show it, and becomes a
PromQL query here (and, for the picture in docs/metrics.md, the same computation over
scraped samples in `tools/metrics_picture.py`).

Ray provisions the dashboards it finds in its session's `metrics/grafana/dashboards`
folder when Grafana is started with the config Ray writes there (Ray's "Configuring and
managing Ray Dashboard" guide); `raytrain-x dashboard --install` puts this one beside
Ray's own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from raytrain_x.ray.metrics import BY_NAME, PREFIX

RAY_PREFIX = "ray_"  # Ray's exporter puts it in front of every application metric
WINDOW = "1m"  # the window of rates


@dataclass(frozen=True)
class Panel:
    """One panel: `metric` (a `metrics.METRICS` name) shown as `how`: `rate` (per second,
    of a counter), `value` (a gauge as it is), `increase` (of a counter over the window),
    `quantile` (`q` of a histogram) or `ratio` (rate of `metric` over rate of `per`);
    summed by the labels `by` (all series summed when empty)."""

    title: str
    metric: str
    how: str
    by: tuple[str, ...] = ()
    unit: str = "short"
    per: str = ""
    q: float = 0.5
    only_ones: bool = False  # keep only series at 1 (the current autotune phase)


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Training", (
        Panel("Steps per second, by rank", "steps", "rate", ("rank",)),
        Panel("Samples per second (the job)", "samples_per_second", "value"),
        Panel("Step time p50", "step_seconds", "quantile", unit="s", q=0.5),
        Panel("Step time p95", "step_seconds", "quantile", unit="s", q=0.95),
        Panel("Steps per second, last interval", "steps_per_second", "value", ("rank",)),
    )),
    ("Engine", (
        Panel("Collective bytes per second, by kind", "collective_bytes", "rate", ("kind",),
              unit="Bps"),
        Panel("Seconds in collectives per second, by rank", "collective_seconds", "rate",
              ("rank",), unit="s"),
        Panel("Tensors per fused batch", "fused_tensors", "ratio", per="fused_batches"),
        Panel("Negotiation round trips per second", "negotiations", "rate"),
        Panel("Response-cache hits per second", "cache_hits", "rate"),
        Panel("Engine cycles per second", "engine_cycles", "rate"),
        Panel("Active cycles per second", "engine_active_cycles", "rate"),
        Panel("Speculated cycles per second", "speculated_cycles", "rate"),
        Panel("Fused batches per second", "fused_batches", "rate"),
        Panel("Stall warnings", "stalls", "increase"),
    )),
    ("Autotune", (
        Panel("Score of each sample", "autotune_sample_score", "value", ("sample",)),
        Panel("Best score so far", "autotune_best_score", "value"),
        Panel("Samples scored", "autotune_samples", "increase"),
        Panel("Knobs in effect", "autotune_knob", "value", ("knob",)),
        Panel("Phase", "autotune_phase", "value", ("phase",), only_ones=True),
    )),
    ("Elastic", (
        Panel("World size", "world_size", "value"),
        Panel("Rounds formed, by why", "rounds", "increase", ("reason",)),
        Panel("Resets", "resets", "increase"),
        Panel("Worker failures, by cause", "worker_failures", "increase", ("cause",)),
        Panel("Elastic events, by kind", "elastic_events", "increase", ("kind",)),
        Panel("Hosts on the blacklist", "blacklisted_hosts", "value"),
        Panel("Recovery time p50", "recovery_seconds", "quantile", unit="s", q=0.5),
    )),
    ("Durable checkpoints", (
        Panel("Checkpoints written", "checkpoints_written", "increase"),
        Panel("Failed writes", "checkpoint_failures", "increase"),
        Panel("Restores from storage", "checkpoint_restores", "increase"),
        Panel("Write or restore time p50", "checkpoint_seconds", "quantile", ("what",),
              unit="s", q=0.5),
        Panel("Commit checkpointed or restored", "checkpoint_commit", "value", ("what",)),
    )),
)
PANELS = tuple(p for _, panels in ROWS for p in panels)


def series_name(metric: str, part: str = "") -> str:
    """The name Prometheus shows: Ray's prefix, ours, `_total` after a counter (or a
    histogram's `_bucket`/`_sum`/`_count` as `part`)."""
    spec = BY_NAME[metric]
    base = RAY_PREFIX + PREFIX + metric
    if spec.kind == "counter":
        return base + "_total"
    return base + (f"_{part}" if part else "")


def promql(panel: Panel) -> str:
    """The panel's query, for the jobs the dashboard's `job` variable selects."""
    sel = '{job=~"$job"}'
    by = f" by ({', '.join(panel.by)})" if panel.by else ""
    name = series_name(panel.metric)
    if panel.how == "rate":
        return f"sum{by} (rate({name}{sel}[{WINDOW}]))"
    if panel.how == "increase":
        return f"sum{by} (increase({name}{sel}[{WINDOW}]))"
    if panel.how == "value":
        query = f"sum{by} ({name}{sel})"
        return f"{query} == 1" if panel.only_ones else query
    if panel.how == "ratio":
        return (f"sum{by} (rate({name}{sel}[{WINDOW}])) / "
                f"sum{by} (rate({series_name(panel.per)}{sel}[{WINDOW}]))")
    if panel.how == "quantile":
        return (f"histogram_quantile({panel.q}, sum by (le{', ' if panel.by else ''}"
                f"{', '.join(panel.by)}) (rate({series_name(panel.metric, 'bucket')}{sel}"
                f"[{WINDOW}])))")
    raise ValueError(f"panel {panel.title!r}: unknown way {panel.how!r}")


def dashboard() -> dict:
    """The dashboard as Grafana's JSON model: a row per group, a time series per panel,
    variables for the Prometheus data source and the jobs shown."""
    panels, y = [], 0
    for row, members in ROWS:
        panels.append({"type": "row", "title": row, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": len(panels) + 1})
        y += 1
        for i, panel in enumerate(members):
            legend = " ".join("{{" + label + "}}" for label in panel.by) or "{{job}}"
            panels.append({
                "type": "timeseries", "title": panel.title, "id": len(panels) + 1,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "description": BY_NAME[panel.metric].doc,
                "gridPos": {"h": 8, "w": 6, "x": (i % 4) * 6, "y": y + (i // 4) * 8},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [{"expr": promql(panel), "legendFormat": legend, "refId": "A",
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}],
            })
        y += ((len(members) + 3) // 4) * 8
    job_query = f"label_values({series_name('steps')}, job)"
    return {
        "title": "raytrain-x", "uid": "raytrain-x", "editable": True, "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["raytrain-x"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Data source"},
            {"name": "job", "type": "query", "label": "Job", "multi": True,
             "includeAll": True, "allValue": ".*", "refresh": 2,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": job_query, "refId": "jobs"}, "definition": job_query},
        ]},
        "panels": panels,
    }


def write(path: str) -> str:
    with open(path, "w") as f:
        json.dump(dashboard(), f, indent=2)
    return path


def ray_dashboards_folder(session_dir: str) -> str:
    """Where Ray's Grafana provisioning looks for dashboards in a session's folder."""
    return os.path.join(session_dir, "metrics", "grafana", "dashboards")

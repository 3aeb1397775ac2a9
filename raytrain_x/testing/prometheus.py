"""Reads what Ray's nodes export to Prometheus (each node's metrics agent serves the text
format at `http://<node>:<MetricsExportPort>/metrics`), as Prometheus would scrape it:
the metrics test and the dashboard picture (`tools/metrics_picture.py`) use it."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Series:
    """One exported value: the metric's full name, its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Series]:
    """The Prometheus text format's samples (comments and blank lines skipped)."""
    found = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        found.append(Series(name, dict(_LABEL.findall(labels or "")), float(value)))
    return found


def scrape(url: str, timeout_s: float = 10.0) -> list[Series]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def node_endpoints() -> list[str]:
    """The metrics URL of every alive node of the connected Ray cluster."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
            for n in ray.nodes() if n["Alive"] and n.get("MetricsExportPort")]


def scrape_cluster(prefix: str = "ray_raytrain_x_", timeout_s: float = 10.0) -> list[Series]:
    """Every alive node's series whose name starts with `prefix` (a node that does not
    answer is left out: it may be going)."""
    found: list[Series] = []
    for url in node_endpoints():
        try:
            found += [s for s in scrape(url, timeout_s) if s.name.startswith(prefix)]
        except OSError:
            continue
    return found


def total(series: list[Series], name: str, **labels: str) -> float:
    """The sum of `name`'s series whose labels include `labels` (0 when there are none)."""
    return sum(s.value for s in series
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

"""Clusters on one machine for tests, benchmarks and trying features out: a local Ray
cluster whose nodes an autoscaler starts and stops (`LocalAutoscalingCluster`), several
hosts joined by a real, shaped network (`EmulatedCluster`), and the process bookkeeping
that stops exactly what such a cluster started.

The clusters load when first named, so that the harness's Ray-free parts (`leaks`,
`waiting`, `results`) import where Ray is not installed, as on a GPU machine that runs
`tests/gpu/` between plain processes.
"""

from __future__ import annotations

from raytrain_x.common.exports import lazy_names

_HOMES: dict[str, str | None] = {
    "LocalAutoscalingCluster": "raytrain_x.testing.autoscaling",
    "drain_node": "raytrain_x.testing.autoscaling",
    "kill_node": "raytrain_x.testing.autoscaling",
    "EmulatedCluster": "raytrain_x.testing.cluster",
    "NamespacesUnavailable": "raytrain_x.testing.cluster",
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_names(__name__, _HOMES)

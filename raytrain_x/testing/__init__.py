"""Clusters on one machine for tests, benchmarks and trying features out: a local Ray
cluster whose nodes an autoscaler starts and stops (`LocalAutoscalingCluster`), several
hosts joined by a real, shaped network (`EmulatedCluster`), and the process bookkeeping
that stops exactly what such a cluster started."""

from raytrain_x.testing.autoscaling import LocalAutoscalingCluster, drain_node, kill_node
from raytrain_x.testing.cluster import EmulatedCluster, NamespacesUnavailable

__all__ = ["EmulatedCluster", "LocalAutoscalingCluster", "NamespacesUnavailable",
           "drain_node", "kill_node"]

"""Clusters on one machine for tests, benchmarks and trying features out: a local Ray
cluster whose nodes an autoscaler starts and stops (`LocalAutoscalingCluster`), and the
process bookkeeping that stops exactly what such a cluster started."""

from raytrain_x.testing.autoscaling import LocalAutoscalingCluster, drain_node, kill_node

__all__ = ["LocalAutoscalingCluster", "drain_node", "kill_node"]

"""Shared fixtures: one real Ray cluster per test session; elastic tests add real nodes."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELASTIC_RESOURCE = "rtx_elastic"


@pytest.fixture(scope="session")
def cluster():
    """A `ray.cluster_utils.Cluster` whose head has 8 logical CPUs (3-worker jobs fit on 2
    cores); the driver is connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 8, "include_dashboard": False})
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(cluster):
    """The session cluster's address."""
    return cluster.address


@pytest.fixture
def elastic_nodes(cluster):
    """Adds nodes that each fit one elastic worker (resource `rtx_elastic`); removes what
    is left of them after the test."""
    added = []

    def add(count: int = 1, **resources: float):
        nodes = [cluster.add_node(num_cpus=1, resources={ELASTIC_RESOURCE: 1, **resources})
                 for _ in range(count)]
        cluster.wait_for_nodes()
        added.extend(nodes)
        return nodes

    yield add
    for node in added:
        if node in cluster.worker_nodes:
            cluster.remove_node(node, allow_graceful=False)

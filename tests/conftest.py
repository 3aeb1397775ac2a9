"""Shared fixtures: one local Ray cluster per test session."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (8 logical CPUs so 3-worker jobs fit on 2 cores)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()

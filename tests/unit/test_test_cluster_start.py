"""The session cluster's start (tests/conftest.py): a start that runs past Ray's own limit
is stopped, processes and all, and tried once more; any other failure is raised at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raytrain_x.common.procs import processes
from tests.conftest import _start_head

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


class _FlakyHead:
    """Stands in for ray.cluster_utils.Cluster: its first start leaves a real process
    behind (as a half-started raylet does) and fails with `error`."""

    starts: list = []

    def __init__(self, **_):
        pass

    def add_node(self, error: str, **_):
        if not _FlakyHead.starts:
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            _FlakyHead.starts.append(child)
            raise Exception(error)
        _FlakyHead.starts.append(None)

    def shutdown(self):
        pass


@pytest.fixture
def flaky():
    _FlakyHead.starts = []
    yield _FlakyHead
    for child in filter(None, _FlakyHead.starts):
        child.kill()
        child.wait()


def test_a_start_past_rays_limit_is_stopped_and_tried_again(flaky):
    with pytest.warns(UserWarning, match="trying once more"):
        _start_head(flaky, {"error": TIMED_OUT})
    first, second = flaky.starts
    assert second is None  # the second start succeeded
    assert first.wait(timeout=10) != 0  # the half-started one's process was killed
    assert first.pid not in processes()


def test_any_other_start_failure_is_raised_at_once(flaky):
    with pytest.raises(Exception, match="port taken"):
        _start_head(flaky, {"error": "port taken"})
    assert len(flaky.starts) == 1

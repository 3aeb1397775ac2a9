"""Two hosts joined by a real network (`raytrain_x.testing.EmulatedCluster`): each host a
network namespace running a Ray node, a 1 Gbit/s tbf-shaped link between them. Faults are
real: the link goes down (a partition), a raylet is killed with SIGKILL. Drivers run on
host 0 (`tests/emulated_jobs.py`), as a job on the head node."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_x.common.settings import PROBE_TIMEOUT_S
from raytrain_x.ray.elastic.settings import STRAGGLER_POLL_S
from raytrain_x.testing.cluster import EmulatedCluster, namespace_pids, unavailable_reason
from tests.limits import SCALE, first_error, limit, wait_until

REPO = Path(__file__).resolve().parents[2]
COLLECTIVE_TIMEOUT_S = 5.0  # RAYTRAIN_X_TIMEOUT of the jobs here
# How long the link stays down: at least until the job has gone on without the host (the
# test waits for that whatever this says), then the rest of it. The outcome is the same
# for any length up to a minute (Ray's settings below): 8 s keeps the suite short (an
# elastic job goes on without the host about 6 s after its link goes down);
# RAYTRAIN_X_TEST_PARTITION_S=60 runs the minute-long partition of docs/multihost.md.
PARTITION_S = float(os.environ.get("RAYTRAIN_X_TEST_PARTITION_S", "8"))
COOLDOWN_S = 5.0
# Ray keeps a node it cannot reach for 90 s (health checks) and a raylet keeps trying its
# GCS for 120 s, so a partition of up to a minute is one the cluster itself survives;
# reconnection backoff is capped at 1 s so the host is usable soon after its link returns.
RAY_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 90,
                     "gcs_rpc_server_reconnect_timeout_s": 120,
                     "gcs_grpc_initial_reconnect_backoff_ms": 100,
                     "gcs_grpc_max_reconnect_backoff_ms": 1000}
# The partition is noticed at the collective timeout; an elastic driver then sees workers
# missing from the rendezvous and silent to its heartbeat at its next poll, a fixed job's
# driver pings them (a bound for both).
NOTICE_S = COLLECTIVE_TIMEOUT_S + 2 * STRAGGLER_POLL_S + PROBE_TIMEOUT_S

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None,
                       reason=f"emulated hosts unavailable: {unavailable_reason()}"),
    pytest.mark.timeout(limit(60, ray_starts=2) + PARTITION_S),
]


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(hosts=2, workers_per_host=2, link_gbit=1.0,
                         system_config=RAY_SYSTEM_CONFIG,
                         start_timeout_s=limit(5, ray_starts=1)) as emulated:
        yield emulated
    # torn down: no namespace of it is left, hence nothing runs in one
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emulated.switch not in names
    assert not any(emulated.namespace(h) in names for h in range(emulated.hosts))


class _Job:
    """A driver script on host 0, with its progress file."""

    def __init__(self, cluster: EmulatedCluster, tmp_path: Path, mode: str) -> None:
        self.progress, self.stop, self.out = (tmp_path / n for n in ("progress", "stop", "out"))
        self.proc = cluster.popen(
            [sys.executable, "-m", "tests.emulated_jobs", mode, "--progress", str(self.progress),
             "--stop", str(self.stop), "--out", str(self.out),
             "--timeout", str(COLLECTIVE_TIMEOUT_S), "--cooldown", str(COOLDOWN_S)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        """What the driver printed so far (all of it, once it has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(10)
        return "\n".join(self.lines)

    def read(self) -> tuple[int, float]:
        """(step, size) of the elastic job, (step, time) of the fixed one."""
        try:
            step, second = self.progress.read_text().split()
            return int(step), float(second)
        except (OSError, ValueError):
            return 0, 0

    def wait_for(self, what: str, condition, work_s: float) -> None:
        def check() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the driver exited ({self.proc.returncode}) while "
                                     f"waiting for {what}; {first_error(self.output())}")
            return condition(*self.read())
        wait_until(check, work_s, what, state=self.read, poll_s=0.1)

    def trains_with(self, size: int, what: str, work_s: float, steps: int = 10) -> float:
        """Waits until the job trains with `size` workers and has committed `steps` more
        steps with them; returns how long it took to get to `size`."""
        began = time.monotonic()
        self.wait_for(what, lambda step, now: now == size, work_s=work_s)
        reached = time.monotonic() - began
        at = self.read()[0]
        self.wait_for(f"{steps} steps with {size} workers",
                      lambda step, now: step >= at + steps, work_s=5)
        return reached

    def finish(self, work_s: float) -> dict:
        self.stop.touch()
        try:
            self.proc.wait(timeout=limit(work_s))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the driver did not finish; {first_error(self.output())}") \
                from None
        assert self.proc.returncode == 0, first_error(self.output())
        return json.loads(self.out.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _check_history(result: dict) -> list[int]:
    """Every rank committed the same steps 0..n-1 once each and ends with equal weights;
    returns the world sizes step by step."""
    ranks = result["results"]
    steps = ranks[0]["done_steps"]
    assert steps == list(range(len(steps)))  # nothing lost or repeated
    assert all(r["done_steps"] == steps and r["weight"] == ranks[0]["weight"] for r in ranks)
    return ranks[0]["sizes"]


def test_cluster_hosts_are_namespaces_with_a_shaped_link(cluster):
    assert cluster.alive_hosts() == [0, 1]
    for host in (0, 1):
        assert namespace_pids(cluster.namespace(host))  # its Ray node runs in it
        assert cluster.raylet_pid(host) is not None
    qdisc = subprocess.run(["ip", "netns", "exec", cluster.namespace(1), "tc", "qdisc",
                            "show", "dev", "eth0"], capture_output=True, text=True).stdout
    assert "tbf" in qdisc and "rate 1Gbit" in qdisc


def test_partitioned_host_leaves_an_elastic_job_and_comes_back_after_its_cooldown(
        cluster, tmp_path):
    job = _Job(cluster, tmp_path, "elastic")
    try:
        job.wait_for("4 workers training", lambda step, size: size == 4 and step >= 5,
                     work_s=20)
        cluster.link_down(1)
        down = time.monotonic()
        try:
            noticed = job.trains_with(2, "training to go on with host 0's 2 workers",
                                      work_s=NOTICE_S)
            time.sleep(max(0.0, down + PARTITION_S - time.monotonic()))
        finally:
            cluster.link_up(1)
        rejoined = job.trains_with(4, "host 1 to rejoin", work_s=30, steps=5)
        result = job.finish(work_s=10)
    finally:
        job.kill()
    sizes = _check_history(result)
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4
    reasons = [h["reason"] for h in result["history"]]
    assert reasons[:3] == ["start", "failure", "scale_up"], result["history"]
    assert result["history"][1]["failed"] == 2 and result["history"][1]["hosts"] == 1
    assert noticed <= SCALE * (NOTICE_S + 10), noticed  # within the collective timeout
    print(f"partition noticed after {noticed:.1f}s; host back {rejoined:.1f}s after its link")


def test_partition_fails_a_fixed_job_naming_the_unreachable_ranks(cluster, tmp_path):
    job = _Job(cluster, tmp_path, "fixed")
    try:
        job.wait_for("the job to run", lambda step, _: step >= 20, work_s=20)
        cluster.link_down(1)
        down = time.time()
        try:
            job.proc.wait(timeout=limit(NOTICE_S))
        finally:
            cluster.link_up(1)
    finally:
        job.kill()
    assert job.proc.returncode == 0, first_error(job.output())
    error = json.loads(job.out.read_text())
    assert error["type"] == "WorkerError", error
    # the two ranks of host 1, whichever they are
    assert re.search(r"ranks \[(0, 1|2, 3)\] are unreachable", error["error"]), error["error"]
    assert cluster.host_ip(1) in error["error"]
    assert error["at"] - down <= SCALE * (COLLECTIVE_TIMEOUT_S + PROBE_TIMEOUT_S + 10)


def test_killed_raylet_leaves_the_elastic_job_on_the_other_host(cluster, tmp_path):
    cluster.wait_for_nodes(2, limit(10))
    job = _Job(cluster, tmp_path, "elastic")
    try:
        job.wait_for("4 workers training", lambda step, size: size == 4 and step >= 5,
                     work_s=20)
        cluster.kill_raylet(1)
        job.trains_with(2, "training to go on with host 0's 2 workers", work_s=NOTICE_S)
        result = job.finish(work_s=10)
    finally:
        job.kill()
    sizes = _check_history(result)
    assert 4 in sizes and sizes[-1] == 2
    last = result["history"][-1]
    assert last["reason"] == "failure" and last["size"] == 2 and last["hosts"] == 1

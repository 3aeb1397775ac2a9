"""Elastic jobs on an autoscaling cluster: Ray's fake multi-node provider, whose "nodes" are
real raylets that Ray's real autoscaler starts and stops (raytrain_x.testing). The job's
driver is examples/elastic_autoscaling.py in its own process, connected to that cluster;
the test drains and kills nodes from outside, as the autoscaler and a cloud would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from raytrain_x.testing import LocalAutoscalingCluster, drain_node, kill_node
from tests.limits import RAY_START_S, first_error, limit, wait_until

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "elastic_autoscaling.py"
CLUSTER_YAML = REPO / "examples" / "clusters" / "local-fake.yaml"
pytestmark = pytest.mark.timeout(limit(120, ray_starts=5))


@pytest.fixture(scope="module")
def autoscaling():
    """One autoscaling cluster for the module: head only (0 CPUs), up to four 1-CPU nodes,
    idle nodes removed after 3 s. Each test starts from the head alone. The order in which
    nodes arrive is set by each test (`allow_launches`), not by a launch delay."""
    cluster = LocalAutoscalingCluster(config_file=str(CLUSTER_YAML), node_launch_delay_s=0,
                                      idle_timeout_minutes=0.05,
                                      start_timeout_s=limit(10, ray_starts=1))
    try:  # a start that fails half-way is stopped by start() itself
        cluster.start()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def cluster(autoscaling):
    """The module's cluster once the nodes of the test before are gone, launching nodes
    without a limit until the test sets one."""
    wait_until(lambda: not autoscaling.worker_nodes(), 15,
               "the worker nodes of the test before to be removed",
               state=autoscaling.worker_nodes, poll_s=0.5)
    autoscaling.allow_launches(None)
    try:
        yield autoscaling
    finally:
        autoscaling.allow_launches(None)


class _Driver:
    """examples/elastic_autoscaling.py against `cluster`, its output followed line by
    line; the job trains until `stop()`."""

    def __init__(self, cluster: LocalAutoscalingCluster, tmp: Path, *args: str) -> None:
        self.until = tmp / "stop"
        self.json = tmp / "job.json"
        self.progress = tmp / "progress"
        self.lines: list[str] = []
        self.cluster = cluster
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--address", cluster.address, "--until-file",
             str(self.until), "--json", str(self.json), "--progress", str(self.progress),
             "--step-pause", "0.02", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def rounds(self) -> list[tuple[int, str]]:
        """(size, reason) of each round line the driver printed."""
        found = []
        for line in self.lines:
            m = re.search(r"round \d+ at [\d.]+s: (\d+) workers on \d+ host\(s\) \(([^)]*)\)",
                          line)
            if m:
                found.append((int(m.group(1)), m.group(2)))
        return found

    def wait_for_round(self, size: int, reason: str, work_s: float) -> None:
        def reached() -> bool:
            assert self.proc.poll() is None, "the job ended early; " + first_error(self.output())
            return any(s == size and reason in r for s, r in self.rounds())

        wait_until(reached, work_s, f"a round of {size} workers ({reason})",
                   state=self.tail, poll_s=0.2)

    def trained_at(self, size: int, steps: int = 3, work_s: float = 10) -> None:
        """Waits until rank 0 has committed `steps` more steps in a world of `size`."""
        start = [None]

        def reached() -> bool:
            try:
                step, world, _ = map(int, self.progress.read_text().split())
            except (OSError, ValueError):
                return False
            if world != size:
                return False
            start[0] = step if start[0] is None else start[0]
            return step >= start[0] + steps

        wait_until(reached, work_s, f"{steps} steps with {size} workers", state=self.tail,
                   poll_s=0.05)

    def restores(self) -> int:
        """How often rank 0 has restored the last commit so far (every survivor of a failure
        restores it, so rank 0's count is the round's)."""
        return int(self.progress.read_text().split()[2])

    def tail(self) -> str:
        """The driver's last lines, and the last error lines of each worker's log (what a
        hang or a failure of this job left there)."""
        return "\n".join(self.lines[-15:]) + _worker_log_tails(self.cluster)

    def output(self) -> str:
        if self.proc.poll() is not None:
            self._reader.join(10)
        return "\n".join(self.lines)

    def stop(self, work_s: float = 20) -> dict:
        """Ends the training; returns the job's JSON (history, results, summary)."""
        self.until.touch()
        try:
            self.proc.wait(limit(work_s))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {limit(work_s):.0f}s of "
                                 f"being asked to:\n{self.tail()}") from None
        self._reader.join(5)
        assert self.proc.returncode == 0, first_error(self.output())
        return json.loads(self.json.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _worker_log_tails(cluster: LocalAutoscalingCluster, lines: int = 6) -> str:
    """The last lines of each worker process's stderr in the cluster's session logs."""
    if cluster.temp_dir is None:
        return ""
    logs = sorted(Path(cluster.temp_dir).glob("session_latest/logs/worker-*.err"),
                  key=lambda p: p.stat().st_mtime)
    parts = []
    for log in logs[-8:]:
        text = [line for line in log.read_text(errors="replace").splitlines()
                if line.strip() and not line.startswith(":")]
        if text:
            parts.append(f"--- {log.name}\n" + "\n".join(text[-lines:]))
    return "\n" + "\n".join(parts) if parts else ""


def _worker_log_lines(cluster: LocalAutoscalingCluster, text: str) -> list[str]:
    """The lines of the workers' stderr logs that contain `text`."""
    if cluster.temp_dir is None:
        return []
    return [line for log in Path(cluster.temp_dir).glob("session_latest/logs/worker-*.err")
            for line in log.read_text(errors="replace").splitlines() if text in line]


def _check_committed_history(job: dict) -> None:
    summary = job["summary"]
    assert summary["each_step_once"], [r["done_steps"][:20] for r in job["results"]]
    assert summary["weights_equal"], [r["weights_equal_check"] for r in job["results"]]
    assert summary["steps"] > 0


def test_grows_to_max_workers_then_scales_down(cluster, tmp_path):
    """Head only at the start; the job asks the autoscaler for 4 workers' room and grows
    to 4 while training. After it ends its request is withdrawn and the autoscaler removes
    the idle nodes. The first round forms on the one node allowed to come up; the other
    three come up only after it (on a fast machine they would all be up before it)."""
    cluster.allow_launches(1)
    driver = _Driver(cluster, tmp_path, "--min-workers", "1", "--max-workers", "4")
    try:
        wait_until(lambda: driver.rounds(), 25 + RAY_START_S / 4, "the first round",
                   state=driver.tail, poll_s=0.2)
        assert driver.rounds()[0][0] == 1, driver.tail()
        assert cluster.resource_request() == [{"CPU": 1.0}] * 4
        cluster.allow_launches(None)
        driver.wait_for_round(4, "scale_up", work_s=60)
        driver.trained_at(4)
        job = driver.stop()
    finally:
        driver.kill()
    _check_committed_history(job)
    assert job["summary"]["workers_finished"] == 4
    assert 4 in job["summary"]["sizes_seen"]
    sizes = [h["size"] for h in job["history"]]
    assert sizes[0] < 4 and sizes == sorted(sizes), job["history"]  # grew while training
    assert job["history"][0]["requested"] == 4
    # a restore here means a worker met an error while the job only grew: the history and
    # the workers' last log lines say which
    assert job["summary"]["restores"] == 0, (
        f"{job['history']}\n" + "\n".join(
            [line for line in driver.lines if " failed (" in line]
            + _worker_log_lines(cluster, "restoring the last")) + _worker_log_tails(cluster))
    # scale-down: nothing asked of the autoscaler any more, idle nodes removed
    assert cluster.resource_request() == []
    wait_until(lambda: not cluster.worker_nodes(), 20,
               "the autoscaler to remove the idle worker nodes (idle_timeout_minutes=0.05)",
               state=cluster.worker_nodes, poll_s=0.5)


def _drain_one_of_three(cluster: LocalAutoscalingCluster, driver: _Driver) -> list[str]:
    """Once the job has 3 workers, drains the newest worker node with a spot notice (60 s
    deadline) and waits for the round of the 2 left; returns the worker nodes before. No
    node comes up after the job has its 3, so no replacement joins before the test has seen
    what it waits for, however fast the autoscaler is. The drain comes once the round of 3
    has committed a step: mid-job, not while that round still forms (a round given up)."""
    driver.wait_for_round(3, "", work_s=60)
    cluster.allow_launches(0)
    driver.trained_at(3, steps=1)
    nodes = cluster.worker_nodes()
    drain_node(cluster.address, nodes[-1], deadline_s=60)
    driver.wait_for_round(2, "drain", work_s=20)
    return nodes


def test_a_drained_node_leaves_at_a_commit_and_a_killed_node_fails_in_one_job(cluster,
                                                                             tmp_path):
    """A spot notice (`ray drain-node`, reason preemption, 60 s deadline) mid-job: the
    node's worker leaves at the next commit, the others go on without restoring anything,
    and the round history says drain, not failure. Then another node is killed (`kill -9`
    of all its processes): a failure the survivor recovers from by restoring the last
    commit, and the job finishes with every step done once."""
    driver = _Driver(cluster, tmp_path, "--min-workers", "1", "--max-workers", "3")
    try:
        nodes = _drain_one_of_three(cluster, driver)
        driver.trained_at(2)
        assert driver.restores() == 0
        assert not any("failure" in r for _, r in driver.rounds()), driver.rounds()
        # A kill as the drain's round connects held the survivor in torch's gloo connect
        # for 5 x the timeout until groups bounded it
        assert kill_node(nodes[0]) > 0
        wait_until(lambda: any("failure" in r for _, r in driver.rounds()), 30,
                   "a round after the killed node's failure", state=driver.tail, poll_s=0.2)
        driver.trained_at(1)
        job = driver.stop()
    finally:
        driver.kill()
    _check_committed_history(job)
    history = job["history"]
    drain = next(i for i, h in enumerate(history) if "drain" in h["reason"])
    failure = next(i for i, h in enumerate(history) if "failure" in h["reason"])
    assert history[drain]["left"] == 1 and history[drain]["failed"] == 0, history
    assert drain < failure, history
    assert history[-1]["size"] == 1, history
    assert job["summary"]["restores"] >= 1  # the kill's


def test_requests_the_autoscaler_cannot_meet_time_out_naming_the_request(cluster, tmp_path):
    """min_workers=5 on a cluster of at most four 1-CPU nodes: the job asks for room for 5,
    gets 4 nodes, and ends with ElasticTimeout naming what it asked for."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--address", cluster.address, "--min-workers", "5",
         "--max-workers", "5", "--elastic-timeout", "8", "--steps", "5"],
        capture_output=True, text=True, cwd=REPO, timeout=limit(60))
    assert out.returncode != 0
    assert "ElasticTimeout" in out.stderr, first_error(out.stderr)
    assert "asked the autoscaler for room for 5 workers of {CPU: 1}" in out.stderr, \
        out.stderr[-3000:]
    assert cluster.resource_request() == []  # withdrawn when the job failed


@pytest.mark.parametrize("bad, expected", [
    (["--cpus-per-worker", "2"], "a worker needs {CPU: 2}, which no node of this cluster "
                                 "and no node type of its autoscaler offers"),
    (["--min-workers", "3", "--max-workers", "2"], "need 1 <= min_workers <= max_workers"),
], ids=["no-node-type-fits", "max-below-min"])
def test_bad_input_is_a_clear_error_before_any_worker_starts(cluster, bad, expected):
    """Workers no node type can fit (the autoscaler's node types come from its config),
    and max_workers < min_workers: a ConfigError naming the problem, before anything is
    asked of the autoscaler or started."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--address", cluster.address, "--steps", "5", *bad],
        capture_output=True, text=True, cwd=REPO, timeout=limit(20))
    assert out.returncode == 1
    assert "ConfigError" in out.stderr and expected in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert cluster.resource_request() == []
    assert not cluster.worker_nodes()

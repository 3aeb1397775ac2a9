"""Shared fixtures: one real Ray cluster per test session; elastic tests add real nodes."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

from raytrain_x.common.procs import kill
from raytrain_x.testing import leaks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELASTIC_RESOURCE = "rtx_elastic"
TEMP_PREFIX = "rtx"  # every temp dir the suite makes in /tmp: Ray's and the job test's


@pytest.fixture(scope="session")
def cluster():
    """A `ray.cluster_utils.Cluster` whose head has 8 logical CPUs (3-worker jobs fit on 2
    cores); the driver is connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # No dashboard. The log monitor stays: it carries workers' prints to drivers, and the
    # CLI tests read an elastic job's results from them (without it the job succeeds
    # silently). tools/ray_idle_cpu.py measures what each costs.
    # Its own temp dir (a short path: Ray's unix sockets live there), removed at the end.
    # Every Ray process reports its metrics every 2 s instead of 10 (the metrics test reads
    # them from Prometheus's endpoints; an idle head's CPU did not move measurably).
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    head = {"num_cpus": 8, "include_dashboard": False, "temp_dir": temp,
            "_system_config": {"metrics_report_interval_ms": 2000}}
    c = None
    try:  # a start that fails half-way is stopped too
        c = _start_head(Cluster, head)
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO}})
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _start_head(cluster_class, head: dict):
    """Starts the head node, once more if it ran past Ray's own limit (its raylet has 30 s
    to register, not configurable; `start_once_more`). A failed start is stopped, and its
    processes, found as the new Ray processes it started (a node that failed inside its
    constructor is not in the cluster's list), are killed."""
    from raytrain_x.testing.processes import start_once_more

    def start():
        before = leaks.snapshot()
        c = cluster_class(initialize_head=False, connect=False)
        try:
            c.add_node(**head)
            return c
        except Exception:
            c.shutdown()
            # beside another suite process, only this one's own (the other runs Ray too)
            kill(leaks.new_processes(before, ray_anywhere=not _in_parallel()))
            raise

    return start_once_more(start, "Ray's head node")


def pytest_collection_modifyitems(config, items):
    """Scales every test's pytest-timeout limit as tests/limits.py scales its limits (the
    suite processes sharing the machine, RAYTRAIN_X_TEST_TIME_SCALE)."""
    from tests.limits import SCALE

    if SCALE == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark and mark.args else default
        if seconds:
            item.add_marker(pytest.mark.timeout(seconds * SCALE))


def pytest_collection_finish(session):
    """The selected tests' background commands start now (tests/background.py). In a
    parallel run each suite process collects every test but runs some: a command starts
    when its test's module does instead (`_background_of_module`)."""
    from tests import background

    if not _in_parallel():
        background.start_selected(session.items)


@pytest.fixture(autouse=True, scope="module")
def _background_of_module(request):
    """In a parallel run, the module's background commands start with its first test."""
    if _in_parallel():
        from tests import background

        background.start_selected([i for i in request.session.items
                                   if i.module is request.module])
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test stopped by pytest-timeout also reports what the Ray cluster was doing: what it
    had free and the placement groups still waiting for room."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or "Timeout" not in str(call.excinfo.value):
        return
    report.sections.append(("Ray cluster at the timeout", _ray_state()))


def _ray_state() -> str:
    import ray

    if not ray.is_initialized():
        return "not connected"
    try:
        waiting = [f"{pg['placement_group_id'][:8]} {pg['strategy']} {list(pg['bundles'].values())}"
                   for pg in ray.util.placement_group_table().values()
                   if pg["state"] not in ("CREATED", "REMOVED")]
        return (f"free {ray.available_resources()}\nof {ray.cluster_resources()}\n"
                f"placement groups waiting: {waiting or 'none'}")
    except Exception as exc:  # noqa: BLE001 - a report, not a test
        return f"could not ask the cluster: {exc!r}"


@pytest.fixture(scope="module")
def tensorflow_ranks():
    """The module's ranks (`tests/workers.py`) fork from a server that has imported
    TensorFlow once; the TensorFlow test files use it for all their tests."""
    from tests.workers import preloaded

    with preloaded("tensorflow", env={"TF_CPP_MIN_LOG_LEVEL": "3"}):
        yield


@pytest.fixture(scope="session")
def ray_cluster(cluster):
    """The session cluster's address."""
    return cluster.address


# Nodes of elastic tests, kept for the next test that asks for nodes (a Ray node takes
# seconds to start on 2 cores; the elastic tests once started 20 of them). A test that does
# not ask for them never sees them: they are removed before it starts.
_elastic_pool: list = []
_pool_cluster: list = []  # the session cluster the pool's nodes belong to


def _remove_nodes(cluster, nodes) -> None:
    """Removes kept nodes gracefully: the raylet tells the GCS it leaves, so the next
    `wait_for_nodes` sees it gone at once (a killed raylet is declared dead only after the
    GCS's health checks, about 15 s, which the next test waited out)."""
    for node in nodes:
        if node in cluster.worker_nodes:
            cluster.remove_node(node, allow_graceful=True)


@pytest.fixture(autouse=True)
def _no_stray_elastic_nodes(request):
    """Before a test that does not use `elastic_nodes`: the kept nodes are removed, so
    placement sees the session's head alone, as the test expects."""
    if _elastic_pool and "elastic_nodes" not in request.fixturenames:
        _remove_nodes(_pool_cluster[0], _elastic_pool)
        _elastic_pool.clear()


@pytest.fixture
def elastic_nodes(cluster):
    """Adds nodes that each fit one elastic worker (resource `rtx_elastic`). The nodes of the
    test before are reused for a test's first call (any more are removed, so the test sees
    exactly what it asked for); nodes still up afterwards are kept for the next test."""
    _pool_cluster[:] = [cluster]
    handed: list = []
    special: list = []  # nodes with resources of their own: not for another test

    def add(count: int = 1, num_cpus: int = 1, **resources: float):
        nodes = []
        own = bool(resources) or num_cpus != 1  # a node of its own kind: not for reuse
        if not handed and not special:  # the test's first call
            alive = [n for n in _elastic_pool if n in cluster.worker_nodes]
            nodes = [] if own else alive[:count]
            _remove_nodes(cluster, alive[len(nodes):])
            _elastic_pool.clear()
        added = [cluster.add_node(num_cpus=num_cpus,
                                  resources={ELASTIC_RESOURCE: 1, **resources})
                 for _ in range(count - len(nodes))]
        cluster.wait_for_nodes()
        (special if own else handed).extend(added)
        handed.extend(nodes)
        return nodes + added

    try:
        yield add
    finally:
        _remove_nodes(cluster, special)
        _elastic_pool.extend(n for n in handed if n in cluster.worker_nodes)


# ---------------------------------------------------------------- session-end leak check
# Everything the suite starts must be gone when it ends: Ray processes (found by what they
# run, since stray ones are re-parented to init), processes descended from pytest,
# shared-memory segments of the engine and the temp dirs of the session cluster and the
# job-submit test. The run fails
# otherwise. RAYTRAIN_X_LEAK_CHECK=0 turns it off.
_at_start: dict = {}


def _in_parallel() -> bool:
    """This process is one of several running the suite (pytest-xdist's `-n`)."""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    # Every process the suite starts (Ray's, spawned workers, the CLI's subprocesses) makes
    # its temp files under one folder, removed at the end: Ray's dashboard leaves its
    # forkserver's `pymp-*` folder behind when its cluster is stopped, and a local cluster
    # that `raytrain-x run` starts leaves its session folder. pytest's own tmp_path stays in
    # the system temp dir (read and cached first), so a failed test's files are kept.
    # Each suite process of a parallel run has its own (Ray writes the address of the last
    # cluster started there, and `ray.init()` reads it).
    tempfile.gettempdir()
    _at_start["tmpdir"] = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = _at_start["children_temp"] = tempfile.mkdtemp(
        prefix=f"{TEMP_PREFIX}tmp", dir="/tmp")
    # Ray writes the address of the last cluster started to $TMPDIR/ray without making it
    os.mkdir(os.path.join(_at_start["children_temp"], "ray"))
    # Ray starts idle Python workers ahead of need: one per CPU of the head when the first
    # driver connects, one on each node added. The suite's driver has a runtime_env, so its
    # actors never start on them; every test cluster does without them.
    for setting in ("RAY_enable_worker_prestart", "RAY_prestart_worker_first_driver"):
        os.environ.setdefault(setting, "0")
    # The snapshot is taken before the suite's processes start (pytest-xdist starts them
    # after this hook).
    _at_start["before"] = leaks.snapshot(TEMP_PREFIX)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Each suite process stops what it started; the one that started them all (the only
    one, or the controller of a parallel run, once the others have exited: pytest-xdist
    stops them before this hook) checks that nothing is left."""
    if not _at_start:
        return
    try:
        _stop_fork_server()
        _stop_background()
        if not _in_parallel():
            _check_leaks(session)
    finally:
        _remove_children_temp()


def _stop_fork_server() -> None:
    """Stops the fork server `tests/workers.py` starts its ranks from (it would be counted
    as left behind)."""
    if "tests.workers" not in sys.modules:  # never started (a parallel run's controller)
        return
    from tests.workers import stop_fork_server

    stop_fork_server()


def _stop_background() -> None:
    """Kills the background commands still running (a test that was not reached)."""
    from tests import background

    background.stop_all()


def _remove_children_temp() -> None:
    if _at_start["tmpdir"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _at_start["tmpdir"]
    shutil.rmtree(_at_start["children_temp"], ignore_errors=True)


def _check_leaks(session) -> None:
    if os.environ.get("RAYTRAIN_X_LEAK_CHECK") == "0":
        return
    found = leaks.wait_until_clean(_at_start["before"])
    if found:
        print("\nraytrain-x tests left these behind (the run fails):\n" + leaks.describe(found))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

"""Cooldown rule, blacklist and discovery parsing (pure logic)."""

from __future__ import annotations

import random
import time

import pytest

from raytrain_x import ConfigError
from raytrain_x.ray.elastic.blacklist import Blacklist, cooldown_seconds
from raytrain_x.ray.elastic.discovery import (
    DiscoveryHealth,
    ObjectDiscovery,
    ScriptDiscovery,
    StaticDiscovery,
    parse_host_slots,
    parse_hosts,
    slots_from_resources,
)


def test_cooldown_doubles_from_lo_and_caps_at_hi():
    assert [cooldown_seconds(n, (2, 20)) for n in range(1, 7)] == [2, 4, 8, 16, 20, 20]
    assert cooldown_seconds(1, (2, 20), jitter=1.5) == 3.5
    assert cooldown_seconds(5, (2, 20), jitter=1.5) == 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_blacklist_with_cooldown_returns_after_the_rule():
    clock = FakeClock()
    bl = Blacklist((2.0, 20.0), clock=clock, rng=random.Random(0))
    first = bl.record_failure("n1")
    assert 2.0 <= first <= 4.0  # lo plus jitter up to lo
    assert bl.is_blacklisted("n1") and bl.blacklisted() == ["n1"]
    clock.now += first + 0.01
    assert not bl.is_blacklisted("n1")
    second = bl.record_failure("n1")
    assert 4.0 <= second <= 6.0
    assert not bl.is_blacklisted("other")


def test_blacklist_without_cooldown_is_permanent():
    clock = FakeClock()
    bl = Blacklist(None, clock=clock)
    assert bl.record_failure("n1") == float("inf")
    clock.now += 1e9
    assert bl.is_blacklisted("n1")


def test_parse_host_slots():
    text = "# hosts\nnode-1:4\n\n10.0.0.2:2  # gpu box\n"
    assert parse_host_slots(text) == {"node-1": 4, "10.0.0.2": 2}


@pytest.mark.parametrize("bad", ["node-1", "node-1:four", ":3", "node-1:-1"])
def test_bad_script_output_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="is not 'host:slots'"):
        parse_host_slots(f"ok:1\n{bad}\n")


def test_horovods_host_forms_bare_hosts_hostfiles_and_dash_h():
    """horovodrun's `--slots` for a discovery script's bare host names, Open MPI's hostfile
    lines, and `-H host:slots,host` (a bare host has one slot)."""
    assert parse_host_slots("host-1\nhost-2:2\n", default_slots=4) == {"host-1": 4,
                                                                       "host-2": 2}
    assert parse_host_slots("a slots=3\nb:1\n") == {"a": 3, "b": 1}
    with pytest.raises(ConfigError, match="needs --slots-per-host"):
        parse_host_slots("host-1\n")
    assert parse_hosts("localhost:2,node-b") == {"localhost": 2, "node-b": 1}
    assert parse_hosts("node-a,node-b", default_slots=3) == {"node-a": 3, "node-b": 3}
    with pytest.raises(ConfigError, match="at least one slot"):
        StaticDiscovery({"a": 0})


def test_a_discovery_object_is_read_as_a_script_is():
    """Horovod's `settings.discovery = ...` objects: their hosts, and a failure after a
    success keeps the last hosts (with a warning) as a script's does."""
    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def find_available_hosts_and_slots(self):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("cloud API down")
            return {"a": 2} if self.calls == 1 else {"a": 2, "b": 1}

    discovery = ObjectDiscovery(Flaky())
    assert discovery.hosts() == {"a": 2}
    assert discovery.hosts() == {"a": 2}  # the failure: the last hosts stand
    assert discovery.hosts() == {"a": 2, "b": 1}
    with pytest.raises(ConfigError, match="find_available_hosts_and_slots"):
        ObjectDiscovery(object())


def test_script_must_exist_and_be_executable(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ScriptDiscovery(str(tmp_path / "missing.sh"))
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    with pytest.raises(ConfigError, match="not executable; run: chmod"):
        ScriptDiscovery(str(script))
    script.chmod(0o755)
    assert ScriptDiscovery(str(script)).hosts() == {"localhost": 2}
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(ConfigError, match="exited with 3: oops"):
        ScriptDiscovery(str(failing)).hosts()  # before any success: the script is wrong


def _script(tmp_path, body: str):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def _until(discovery: ScriptDiscovery, expected, seconds: float = 20.0) -> dict:
    deadline = time.monotonic() + seconds
    hosts = discovery.hosts()
    while hosts != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        hosts = discovery.hosts()
    return hosts


def test_a_discovery_failure_after_a_success_keeps_the_last_hosts_and_warns(tmp_path,
                                                                             caplog):
    """One failed run of the script (a timeout, an exit code, a bad line) stopped a running
    elastic job: every in-memory commit was lost."""
    mode = tmp_path / "mode"
    mode.write_text("ok")
    script = _script(tmp_path, f"""m=$(cat {mode})
[ "$m" = fail ] && {{ echo 'cloud API down' >&2; exit 3; }}
[ "$m" = junk ] && {{ echo 'not a host line'; exit 0; }}
[ "$m" = more ] && {{ echo a:2; echo b:2; exit 0; }}
echo a:2
""")
    discovery = ScriptDiscovery(script)
    assert discovery.hosts() == {"a": 2}
    for broken in ("fail", "junk"):
        mode.write_text(broken)
        deadline = time.monotonic() + 20
        while discovery.health.failures < 3 and time.monotonic() < deadline:
            assert discovery.hosts() == {"a": 2}  # the last hosts stand meanwhile
            time.sleep(0.05)
        assert discovery.health.failures >= 3
        mode.write_text("more" if broken == "junk" else "ok")
        deadline = time.monotonic() + 20
        while discovery.health.failures and time.monotonic() < deadline:
            discovery.hosts()  # until a run after the fix has succeeded
            time.sleep(0.05)
        assert discovery.health.failures == 0
    assert _until(discovery, {"a": 2, "b": 2}) == {"a": 2, "b": 2}
    warnings = [r.getMessage() for r in caplog.records if "keeping the 1 host" in r.getMessage()]
    assert any("exited with 3: cloud API down" in w for w in warnings), warnings
    assert any("is not 'host:slots'" in w for w in warnings), warnings


def test_a_discovery_script_failing_for_too_long_stops_the_job_naming_it():
    clock = [0.0]
    health = DiscoveryHealth(failing_for_s=60)
    with pytest.raises(ConfigError, match="exited with 1"):  # before any success: fatal
        health.failed(ConfigError("script exited with 1"), clock[0])
    health.succeeded({"a": 1})
    assert health.failed(ConfigError("script exited with 1"), 10.0).startswith(
        "script exited with 1; keeping the 1 host(s)")
    assert health.failed(ConfigError("script exited with 1"), 11.0) is None  # not every run
    with pytest.raises(ConfigError, match="failing every run for 61s"):
        health.failed(ConfigError("script exited with 1"), 71.0)
    health.succeeded({"a": 1})  # a success starts the count again
    assert health.failed(ConfigError("x"), 200.0) is not None


def test_a_slow_discovery_script_never_holds_up_the_driver(tmp_path):
    """The driver ran the script inline every second: a slow one blocked the loop up to
    its 30 s timeout."""
    first = tmp_path / "first"
    script = _script(tmp_path, f"""[ -e {first} ] && sleep 5
touch {first}
echo a:1
""")
    discovery = ScriptDiscovery(script)
    assert discovery.hosts() == {"a": 1}  # the first run is waited for
    for _ in range(5):
        assert discovery.hosts() == {"a": 1}
    # every call returned while the second run still sleeps: none waited for it
    assert discovery._running is not None and discovery._running.is_alive()


def test_slots_from_resources():
    assert slots_from_resources({"CPU": 7.0, "rtx": 2.0}, {"CPU": 2, "rtx": 1}) == 2
    assert slots_from_resources({"CPU": 1.0}, {"CPU": 2}) == 0


def test_capacity_asked_of_the_autoscaler_counts_unusable_nodes_on_top():
    from raytrain_x.ray.autoscaling import request_bundles

    assert request_bundles(4, 0) == 4
    assert request_bundles(4, 2) == 6  # a blacklisted or draining node's slots
    assert request_bundles(4, -1) == 4


def test_the_v1_monitor_config_gives_the_node_types(tmp_path):
    """The node types are read from the config file of the monitor process of this
    cluster's GCS: a real process whose command line looks like Ray's monitor."""
    import subprocess
    import sys
    import time

    from raytrain_x.ray.autoscaling import monitor_node_types

    config = tmp_path / "cluster.yaml"
    config.write_text("head_node_type: head\navailable_node_types:\n"
                      "  head: {resources: {CPU: 0}, max_workers: 0}\n"
                      "  cpu1: {resources: {CPU: 1}, max_workers: 4}\n"
                      "  never: {resources: {GPU: 8}, max_workers: 0}\n")
    fake = tmp_path / "autoscaler" / "_private"
    fake.mkdir(parents=True)
    (fake / "monitor.py").write_text("import time\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, str(fake / "monitor.py"),
                             "--gcs-address=10.0.0.1:6380",
                             f"--autoscaling-config={config}"])
    try:
        time.sleep(0.2)
        assert monitor_node_types("10.0.0.1:6380") == {"head": {"CPU": 0.0},
                                                       "cpu1": {"CPU": 1.0}}
        assert monitor_node_types("10.0.0.1:6381") is None  # another cluster's monitor
    finally:
        proc.kill()
        proc.wait()


def test_round_history_reasons_counts_and_resets():
    from raytrain_x.ray.elastic.history import RoundHistory, round_line

    now = [100.0]
    history = RoundHistory(clock=lambda: now[0])
    history.note("start", joined=2)
    assert not history.is_reset()  # the first round
    now[0] = 103.5
    first = history.record(1, size=2, hosts=2, starting=1, requested=4, draining_nodes=0)
    assert first["reason"] == "start" and first["joined"] == 2 and first["time_s"] == 3.5
    assert round_line(first) == ("round 1 at 3.5s: 2 workers on 2 host(s) (start); 1 "
                                 "starting, asking the autoscaler for room for 4")
    history.note("drain", left=1)
    assert not history.is_reset()  # a drain alone is not a reset
    drained = history.record(2, size=1, hosts=1, starting=0, requested=0, draining_nodes=1)
    assert (drained["reason"], drained["left"], drained["failed"]) == ("drain", 1, 0)
    assert round_line(drained).endswith("(drain); 0 starting")
    history.note("failure", failed=1)
    history.note("scale_up", joined=1)
    assert history.is_reset()
    both = history.record(3, size=1, hosts=1, starting=0, requested=0, draining_nodes=0)
    assert both["reason"] == "failure+scale_up" and both["joined"] == 1
    assert [e["round"] for e in history.entries] == [1, 2, 3]


def test_the_ledger_check_takes_epochs_in_number_order_after_json():
    """A soak's ranks come back through JSON, whose keys are strings: epoch "9" sorted after
    "25" made the epoch under way look finished (and missing samples)."""
    import json

    from raytrain_x.testing.jobs.ledger import ledger_errors

    seen = {epoch: list(range(4)) for epoch in range(12)}
    seen[12] = [2]  # the epoch under way
    rank = {"rank": 0, "step": 3, "done_steps": [0, 1, 2], "weight": [1.0], "seen": seen}
    assert ledger_errors([rank], samples=4) == []
    assert ledger_errors([json.loads(json.dumps(rank))], samples=4) == []
    seen[3] = [0, 1, 1, 3]
    assert ledger_errors([json.loads(json.dumps(rank))], samples=4) == [
        "rank 0: epoch 3 did not see each sample once"]


def test_test_discovery_moves_hosts_in_and_out_within_its_bounds(monkeypatch):
    """Horovod's `TestDiscovery` for local clusters: one host taken out or put back per
    change, never fewer than `min_hosts` nor more than `max_hosts` (once it has changed),
    only Ray's alive nodes, with the slots their resources hold."""
    from raytrain_x.ray.elastic import ray_nodes

    nodes = {f"n{i}": {"CPU": 2.0} for i in range(4)}
    monkeypatch.setattr(ray_nodes, "alive_nodes", lambda: nodes)
    discovery = ray_nodes.TestDiscovery(min_hosts=1, max_hosts=3, change_frequency_s=0.0,
                                        cpus_per_slot=1, verbose=False, seed=3)
    seen = [discovery.find_available_hosts_and_slots() for _ in range(40)]
    assert all(1 <= len(hosts) <= 3 and set(hosts) <= set(nodes) for hosts in seen)
    assert all(slots == 2 for hosts in seen for slots in hosts.values())
    assert len({frozenset(h) for h in seen}) > 3  # it moved hosts around
    assert all(len(set(a) ^ set(b)) <= 1 for a, b in zip(seen, seen[1:]))


def test_the_heartbeat_asks_a_bounded_number_of_members_a_poll_each_in_turn():
    """The driver's heartbeat calls a poll are bounded (`HEARTBEATS_PER_POLL`), so its CPU
    a second does not grow with the job (benchmarks/control_plane.py --driver): a small
    job's members are all asked every poll, a large job's each in turn."""
    from raytrain_x.ray.elastic.pool import Member, heartbeat_turn

    small = [Member(f"w{i}", None, "n", i) for i in range(5)]
    assert heartbeat_turn(small, 1, most=8) == small
    members = [Member(f"w{i}", None, "n", i) for i in range(10)]
    asked = [[m.worker_id for m in heartbeat_turn(members, poll, most=4)]
             for poll in range(1, 4)]
    assert asked[0] == ["w0", "w1", "w2", "w3"] and asked[1] == ["w4", "w5", "w6", "w7"]
    assert set(asked[2]) == {"w8", "w9", "w0", "w1"}  # the longest unasked first
    # a member with a call still out (not idle) is not asked again, and others move up
    idle = [m for m in members if m.worker_id != "w2"]
    assert [m.worker_id for m in heartbeat_turn(idle, 4, most=2)] == ["w3", "w4"]

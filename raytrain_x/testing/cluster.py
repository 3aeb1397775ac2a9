"""A multi-host Ray cluster on one machine, with a real network between its hosts.

Each host is a Linux network namespace with its own network stack, joined to the others
by a veth pair through a bridge that lives in a namespace of its own (the switch), so
nothing in the machine's own namespace changes. Every switch port is shaped in both
directions by `tc tbf` (`netem` is not available on every kernel, so the link adds no
propagation delay; tbf's `latency` bounds the queue). Within a host, processes talk over
that host's loopback and share memory as the workers of one machine do. Each host runs a
real Ray node (`ray start` inside its namespace; host 0 is the head), and drivers run in
host 0's namespace through `run` / `popen`, as a job on the head node would.

    with EmulatedCluster(hosts=2, workers_per_host=2, link_gbit=1.0) as cluster:
        cluster.run([sys.executable, "train.py"])       # RAY_ADDRESS points at the head
        cluster.link_down(1); ...; cluster.link_up(1)  # a partition
        cluster.kill_raylet(1)                          # a lost host

Teardown (on exit, also after an exception or Ctrl-C) kills every process inside the
cluster's namespaces by PID, then deletes the namespaces by name and the cluster's temp
dir. Clusters whose creating process died (a killed test run) are swept the next time a
cluster starts. Where namespaces cannot be made (not root, no `ip`/`tc`, a container
without CAP_NET_ADMIN), `unavailable_reason()` says why and `EmulatedCluster` raises
`NamespacesUnavailable` with that reason; tests skip on it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raytrain_x.testing.processes import kill, processes, stop, with_descendants

RAY = str(Path(sys.executable).with_name("ray"))
SUBNET = "10.97.0"  # private to each cluster's switch namespace, so clusters never clash
GCS_PORT = 6379
_PREFIX = "rtxn"  # namespaces: rtxn<creator pid>x<serial>h<host> and ...sw
_NAME = re.compile(rf"^{_PREFIX}(\d+)x(\d+)(?:h\d+|sw)$")
_serial = 0


class NamespacesUnavailable(RuntimeError):
    """This machine (or this user) cannot create network namespaces and shaped links."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")
    return out


def unavailable_reason() -> str | None:
    """Why an emulated cluster cannot run here, or None when it can (checked by making a
    namespace pair with a shaped veth link, then deleting it)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{_PREFIX}{os.getpid()}x999999"
    try:
        _ip("netns", "add", probe + "h0")
        _ip("netns", "add", probe + "sw")
        _ip("link", "add", "eth0", "netns", probe + "h0", "type", "veth",
            "peer", "name", "p0", "netns", probe + "sw")
        _shape(probe + "sw", "p0", 1.0)
    except (RuntimeError, OSError) as exc:
        return f"network namespaces or tc tbf are not permitted here: {exc}"
    finally:
        for suffix in ("h0", "sw"):
            _ip("netns", "del", probe + suffix, check=False)
    return None


def _shape(namespace: str, device: str, gbit: float) -> None:
    """Token-bucket limit on `device`'s egress: `gbit` Gbit/s, a bucket of 2 ms of
    traffic (at least 64 KB: below that a 1 Gbit/s bucket cannot keep up with HZ)."""
    rate = int(gbit * 1e9)
    burst = max(64 << 10, rate // 8 // 500)
    _run_in(namespace, ["tc", "qdisc", "replace", "dev", device, "root", "tbf",
                        "rate", f"{rate}bit", "burst", str(burst), "latency", "20ms"])


def _run_in(namespace: str, cmd: Sequence[str]) -> None:
    out = subprocess.run(["ip", "netns", "exec", namespace, *cmd], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` in {namespace} failed: {out.stderr.strip()}")


def namespace_pids(namespace: str) -> set[int]:
    """The processes running in network namespace `namespace` (empty when it is gone)."""
    out = _ip("netns", "pids", namespace, check=False)
    return {int(p) for p in out.stdout.split()} if out.returncode == 0 else set()


def _our_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines()
            if line.split() and _NAME.match(line.split()[0])]


def sweep_stale() -> list[str]:
    """Removes namespaces (and their processes) of emulated clusters whose creating
    process is gone; returns their names."""
    live = processes()
    stale = [ns for ns in _our_namespaces() if int(_NAME.match(ns).group(1)) not in live]
    for ns in stale:
        stop(with_descendants(namespace_pids(ns), live), grace_s=0.2)
        _ip("netns", "del", ns, check=False)
    return stale


class EmulatedCluster:
    """N hosts as network namespaces with shaped links, each running a Ray node.

    Args:
        hosts: how many hosts (namespaces, Ray nodes); host 0 is the head.
        workers_per_host: CPUs each host's Ray node offers (one per training worker).
        link_gbit: each host's link to the switch, Gbit/s in each direction.
        object_store_mb: each node's object store.
        system_config: Ray `_system_config` for the head (node health-check periods, ...).
        start_timeout_s: how long the nodes may take to come up.

    Attributes:
        address: the head's GCS address (`ip:port`), also `RAY_ADDRESS` for `run`/`popen`.
        temp_dir: the cluster's Ray temp dir (session logs).
    """

    def __init__(self, hosts: int = 2, workers_per_host: int = 2, link_gbit: float = 1.0,
                 *, object_store_mb: int = 200, system_config: dict | None = None,
                 start_timeout_s: float = 90.0) -> None:
        if hosts < 1 or hosts > 200 or workers_per_host < 1 or link_gbit <= 0:
            raise ValueError("EmulatedCluster needs 1..200 hosts, workers_per_host >= 1 "
                             "and a positive link_gbit")
        global _serial
        _serial += 1
        self.hosts = hosts
        self.workers_per_host = workers_per_host
        self.link_gbit = link_gbit
        self.object_store_mb = object_store_mb
        self.system_config = dict(system_config or {})
        self.start_timeout_s = start_timeout_s
        self._base = f"{_PREFIX}{os.getpid()}x{_serial}"
        self.switch = self._base + "sw"
        self.address = f"{self.host_ip(0)}:{GCS_PORT}"
        self.temp_dir: str | None = None
        self._created: list[str] = []

    # ------------------------------------------------------------------ names
    def namespace(self, host: int) -> str:
        self._check_host(host)
        return f"{self._base}h{host}"

    def host_ip(self, host: int) -> str:
        self._check_host(host)
        return f"{SUBNET}.{host + 2}"

    def port(self, host: int) -> str:
        """The switch-side device of `host`'s link."""
        self._check_host(host)
        return f"p{host}"

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise ValueError(f"host {host} is not in 0..{self.hosts - 1}")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self) -> EmulatedCluster:
        reason = unavailable_reason()
        if reason:
            raise NamespacesUnavailable(reason)
        sweep_stale()
        try:
            self._make_network()
            self.temp_dir = tempfile.mkdtemp(prefix="rtxemu", dir="/tmp")  # short: sockets
            for host in range(self.hosts):
                self.start_node(host)
            self.wait_for_nodes(self.hosts, self.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _make_network(self) -> None:
        _ip("netns", "add", self.switch)
        self._created.append(self.switch)
        _run_in(self.switch, ["ip", "link", "add", "br0", "type", "bridge"])
        _run_in(self.switch, ["ip", "link", "set", "br0", "up"])
        for host in range(self.hosts):
            ns, port = self.namespace(host), self.port(host)
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth",
                "peer", "name", port, "netns", self.switch)
            _run_in(ns, ["ip", "addr", "add", f"{self.host_ip(host)}/24", "dev", "eth0"])
            for dev in ("lo", "eth0"):
                _run_in(ns, ["ip", "link", "set", dev, "up"])
            _run_in(self.switch, ["ip", "link", "set", port, "master", "br0"])
            _run_in(self.switch, ["ip", "link", "set", port, "up"])
            _shape(ns, "eth0", self.link_gbit)  # host -> switch
            _shape(self.switch, port, self.link_gbit)  # switch -> host

    def start_node(self, host: int) -> None:
        """Runs `ray start` for `host` in its namespace (again, after `kill_raylet`)."""
        cmd = [RAY, "start", f"--node-ip-address={self.host_ip(host)}",
               f"--num-cpus={self.workers_per_host}", "--num-gpus=0",
               f"--object-store-memory={self.object_store_mb << 20}",
               "--disable-usage-stats", f"--resources={json.dumps({f'host{host}': 1})}"]
        if host == 0:
            cmd += ["--head", f"--port={GCS_PORT}", f"--temp-dir={self.temp_dir}",
                    "--include-dashboard=false"]
            if self.system_config:
                cmd.append("--system-config="
                           + json.dumps(self.system_config, separators=(",", ":")))
        else:
            cmd.append(f"--address={self.address}")
        try:
            out = subprocess.run(["ip", "netns", "exec", self.namespace(host), *cmd],
                                 env=self.env(), capture_output=True, text=True,
                                 timeout=self.start_timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`ray start` on host {host} did not finish in "
                               f"{self.start_timeout_s:.0f}s") from None
        if out.returncode != 0:
            raise RuntimeError(f"`ray start` on host {host} failed:\n{out.stderr[-2000:]}")

    def shutdown(self) -> None:
        """Kills every process in the cluster's namespaces, deletes the namespaces and the
        temp dir. Safe to call twice."""
        procs = processes()
        pids: set[int] = set()
        for ns in self._created:
            pids |= namespace_pids(ns)
        if self.temp_dir:  # Ray processes that somehow left the namespaces
            pids |= {p for p, (_, cmd) in procs.items() if self.temp_dir in cmd}
        stop(with_descendants(pids, procs) - {os.getpid()}, grace_s=0.5)
        for ns in reversed(self._created):
            _ip("netns", "del", ns, check=False)
        self._created.clear()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    # ------------------------------------------------------------------ running things
    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of processes run in the cluster."""
        return {**os.environ, "RAY_ADDRESS": self.address,
                "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **(extra or {})}

    def command(self, cmd: Sequence[str], host: int = 0) -> list[str]:
        """`cmd` wrapped to run inside `host`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *cmd]

    def run(self, cmd: Sequence[str], host: int = 0, env: dict[str, str] | None = None,
            timeout_s: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """Runs `cmd` to completion in `host`'s namespace (a driver, by default on the
        head); output captured as text unless told otherwise."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(cmd, host), env=self.env(env), timeout=timeout_s,
                              **kwargs)

    def popen(self, cmd: Sequence[str], host: int = 0, env: dict[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Starts `cmd` in `host`'s namespace; it is killed at shutdown if still running."""
        return subprocess.Popen(self.command(cmd, host), env=self.env(env), **kwargs)

    def python(self, code: str, host: int = 0, timeout_s: float = 60.0) -> str:
        """Runs Python `code` in `host`'s namespace; returns its stdout, raises with its
        stderr when it fails."""
        out = self.run([sys.executable, "-c", code], host, timeout_s=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"code on host {host} failed:\n{out.stderr[-3000:]}")
        return out.stdout

    def alive_hosts(self) -> list[int]:
        """Hosts whose Ray node the GCS lists as alive (asked from the head)."""
        code = ("import json\n"
                "from ray.core.generated import gcs_pb2\n"
                "from raytrain_x.ray import internals\n"
                f"nodes = internals.gcs_client({self.address!r})"
                ".get_all_node_info(timeout=10)\n"
                "print(json.dumps(sorted(i.node_manager_address for i in nodes.values() "
                "if i.state == gcs_pb2.GcsNodeInfo.ALIVE)))")
        ips = json.loads(self.python(code).strip().splitlines()[-1])
        return sorted(h for h in range(self.hosts) if self.host_ip(h) in ips)

    def wait_for_nodes(self, count: int, timeout_s: float) -> list[int]:
        """Waits until `count` hosts' Ray nodes are alive; returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.alive_hosts()
            if len(alive) == count:
                return alive
            if time.monotonic() > deadline:
                raise TimeoutError(f"hosts {alive} alive after {timeout_s:.0f}s, "
                                   f"waiting for {count}")
            time.sleep(0.5)

    # ------------------------------------------------------------------ faults
    def link_down(self, host: int) -> None:
        """Cuts `host` off the switch (a partition: packets to and from it are lost)."""
        _run_in(self.switch, ["ip", "link", "set", self.port(host), "down"])

    def link_up(self, host: int) -> None:
        _run_in(self.switch, ["ip", "link", "set", self.port(host), "up"])

    def raylet_pid(self, host: int) -> int | None:
        procs = processes()
        for pid in namespace_pids(self.namespace(host)):
            cmd = procs.get(pid, (0, ""))[1]
            if cmd.split(" ", 1)[0].endswith("/raylet"):
                return pid
        return None

    def kill_raylet(self, host: int) -> int:
        """`kill -9` of `host`'s raylet (its workers exit when they notice); returns the
        raylet's pid."""
        pid = self.raylet_pid(host)
        if pid is None:
            raise RuntimeError(f"host {host} runs no raylet")
        kill([pid], signal.SIGKILL)
        return pid

    def stop_host(self, host: int) -> None:
        """Kills everything running on `host` (a host powered off)."""
        stop(with_descendants(namespace_pids(self.namespace(host)), processes()), 0.5)


__all__ = ["EmulatedCluster", "NamespacesUnavailable", "namespace_pids", "sweep_stale",
           "unavailable_reason"]

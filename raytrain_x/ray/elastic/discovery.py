"""Host discovery that needs no Ray: a user's discovery script and `host:slots` parsing.
Ray's own nodes are discovered in `raytrain_x.ray.elastic.ray_nodes`."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.settings import TIMEOUT_S

log = logging.getLogger("raytrain_x.elastic")


def parse_host_slots(text: str, source: str = "discovery script",
                     default_slots: int | None = None) -> dict[str, int]:
    """Parses `host:slots` lines (blank lines and `#` comments ignored); a line of a bare
    `host` has `default_slots` (horovodrun's `--slots`), where given. Open MPI's hostfile
    form `host slots=N` is read too."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, rest = line.partition(" ")
        if rest.strip().startswith("slots="):
            line = f"{name}:{rest.strip()[len('slots='):]}"
        host, sep, slots = line.rpartition(":")
        if not sep and default_slots is not None and line:
            host, slots = line, str(default_slots)
        if not host or not slots.strip().isdigit():
            bare = "" if default_slots is not None else \
                " (a bare host name needs --slots-per-host)"
            raise ConfigError(f"{source} line {number}: {raw!r} is not 'host:slots' (for "
                              f"example 'node-1:4'){bare}")
        hosts[host.strip()] = int(slots)
    return hosts


def parse_hosts(hosts: str, default_slots: int | None = None) -> dict[str, int]:
    """horovodrun's `-H host1:2,host2:2` (a bare host has `default_slots`, else 1)."""
    return parse_host_slots("\n".join(h for h in hosts.split(",") if h.strip()),
                            "-H/--hosts", 1 if default_slots is None else default_slots)


class ObjectDiscovery:
    """A discovery object of Horovod's protocol (`find_available_hosts_and_slots()` ->
    `{host: slots}`, as `settings.discovery = ...` gives `ElasticRayExecutor`), asked on
    the driver; its failures are taken as a script's (`DiscoveryHealth`)."""

    def __init__(self, discovery: Any, clock: Callable[[], float] = time.monotonic) -> None:
        if not callable(getattr(discovery, "find_available_hosts_and_slots", None)):
            raise ConfigError("a host discovery object needs find_available_hosts_and_slots() "
                              f"(Horovod's HostDiscovery), got {type(discovery).__name__}")
        self.discovery = discovery
        self.health = DiscoveryHealth()
        self._clock = clock

    def hosts(self) -> dict[str, int]:
        name = type(self.discovery).__name__
        try:
            found = self.discovery.find_available_hosts_and_slots()
            hosts = {str(h): int(n) for h, n in dict(found).items()}
        except Exception as exc:  # noqa: BLE001 - a user's object: any failure is its own
            warning = self.health.failed(
                ConfigError(f"host discovery {name} failed: {type(exc).__name__}: {exc}"),
                self._clock())
            if warning:
                log.warning("raytrain-x elastic: %s", warning)
            return dict(self.health.last or {})
        self.health.succeeded(hosts)
        return hosts


class StaticDiscovery:
    """A fixed host list (horovodrun's `-H`/`--hostfile`), matched to Ray nodes as a
    discovery script's hosts are."""

    def __init__(self, hosts: dict[str, int]) -> None:
        if not hosts or any(n < 1 for n in hosts.values()):
            raise ConfigError(f"the host list needs hosts with at least one slot each, got "
                              f"{hosts}")
        self._hosts = dict(hosts)

    def hosts(self) -> dict[str, int]:
        return dict(self._hosts)


# After the script's first success, how long it may keep failing (every run) before the job
# stops: a script that reads a cloud API meets its outages, and the hosts it last reported
# are used meanwhile; a script broken for good still stops the job, naming its error
FAILING_FOR_S = 300.0
WARN_EVERY = 10  # a warning at the first failure in a row, then every this many


class DiscoveryHealth:
    """What a failed run of the discovery script means (pure; the clock is passed in):
    before any success, a `ConfigError` (nothing to go on: the script or its setup is
    wrong); after one, the last hosts stand, with a warning, until it has failed for
    `failing_for_s` in a row."""

    def __init__(self, failing_for_s: float = FAILING_FOR_S) -> None:
        self.failing_for_s = failing_for_s
        self.last: dict[str, int] | None = None
        self.failing_since: float | None = None
        self.failures = 0  # in a row

    def succeeded(self, hosts: dict[str, int]) -> None:
        self.last, self.failing_since, self.failures = hosts, None, 0

    def failed(self, error: ConfigError, now: float) -> str | None:
        """Raises `error` when it is fatal; else the warning to log (None: stay quiet)."""
        if self.last is None:
            raise error
        if self.failing_since is None:
            self.failing_since = now
        self.failures += 1
        if now - self.failing_since > self.failing_for_s:
            raise ConfigError(f"{error} (failing every run for {now - self.failing_since:.0f}s "
                              "since its last success; fix the script)")
        if self.failures % WARN_EVERY != 1:
            return None
        return (f"{error}; keeping the {len(self.last)} host(s) it last reported (failure "
                f"{self.failures} in a row; the job stops after {self.failing_for_s:.0f}s of "
                "failures)")


class ScriptDiscovery:
    """Runs an executable that prints `host:slots` lines; hosts are matched to Ray nodes by
    IP address, hostname or node id. The first run is waited for; later ones run in the
    background (`hosts()` starts one when none is under way and returns the latest
    answer), so a slow script never holds up the driver, and a failure after a success
    is transient (`DiscoveryHealth`)."""

    def __init__(self, script: str, timeout_s: float = TIMEOUT_S.default,
                 failing_for_s: float = FAILING_FOR_S,
                 clock: Callable[[], float] = time.monotonic,
                 default_slots: int | None = None) -> None:
        if not os.path.isfile(script):
            raise ConfigError(f"host discovery script {script!r} does not exist")
        if not os.access(script, os.X_OK):
            raise ConfigError(f"host discovery script {script!r} is not executable; "
                              f"run: chmod +x {script}")
        self.script = script
        self.default_slots = default_slots
        self.timeout_s = timeout_s
        self.health = DiscoveryHealth(failing_for_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._outcome: dict[str, int] | ConfigError | None = None  # the last run's, unread
        self._running: threading.Thread | None = None

    def hosts(self) -> dict[str, int]:
        """The hosts of the latest run: the first is waited for; later calls start the
        next run in the background when none is under way."""
        if self.health.last is None:
            self._take(self.run_once())
            return dict(self.health.last)
        with self._lock:
            outcome, self._outcome = self._outcome, None
            if self._running is None or not self._running.is_alive():
                self._running = threading.Thread(target=self._run_in_background, daemon=True,
                                                 name="raytrain-x-discovery")
                self._running.start()
        if outcome is not None:
            self._take(outcome)
        return dict(self.health.last)

    def _take(self, outcome: dict[str, int] | ConfigError) -> None:
        if isinstance(outcome, ConfigError):
            warning = self.health.failed(outcome, self._clock())
            if warning:
                log.warning("raytrain-x elastic: %s", warning)
        else:
            self.health.succeeded(outcome)

    def _run_in_background(self) -> None:
        outcome = self.run_once()
        with self._lock:
            self._outcome = outcome

    def run_once(self) -> dict[str, int] | ConfigError:
        """One run of the script: its hosts, or the error that says why there are none."""
        try:
            out = subprocess.run([self.script], capture_output=True, text=True,
                                 errors="backslashreplace", timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            return ConfigError(f"host discovery script {self.script!r} did not finish in "
                               f"{self.timeout_s:g}s")
        except OSError as exc:
            return ConfigError(f"host discovery script {self.script!r} could not run: {exc}")
        if out.returncode != 0:
            return ConfigError(f"host discovery script {self.script!r} exited with "
                               f"{out.returncode}: {out.stderr.strip()[:300]}")
        try:
            return parse_host_slots(out.stdout, f"host discovery script {self.script!r}",
                                    self.default_slots)
        except ConfigError as exc:
            return exc


def slots_from_resources(available: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    """How many workers fit in `available` resources."""
    fits = [math.floor(available.get(name, 0.0) / need + 1e-9)
            for name, need in per_worker.items() if need > 0]
    return max(0, min(fits)) if fits else 0

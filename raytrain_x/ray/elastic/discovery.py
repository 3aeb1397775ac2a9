"""Host discovery that needs no Ray: a user's discovery script and `host:slots` parsing.
Ray's own nodes are discovered in `raytrain_x.ray.elastic.ray_nodes`."""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Mapping

from raytrain_x.common.errors import ConfigError
from raytrain_x.common.settings import TIMEOUT_S


def parse_host_slots(text: str, source: str = "discovery script") -> dict[str, int]:
    """Parses `host:slots` lines (blank lines and `#` comments ignored)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, slots = line.rpartition(":")
        if not sep or not host or not slots.strip().isdigit():
            raise ConfigError(f"{source} line {number}: {raw!r} is not 'host:slots' (for "
                              "example 'node-1:4')")
        hosts[host.strip()] = int(slots)
    return hosts


class ScriptDiscovery:
    """Runs an executable that prints `host:slots` lines; hosts are matched to Ray nodes by
    IP address, hostname or node id."""

    def __init__(self, script: str, timeout_s: float = TIMEOUT_S.default) -> None:
        if not os.path.isfile(script):
            raise ConfigError(f"host discovery script {script!r} does not exist")
        if not os.access(script, os.X_OK):
            raise ConfigError(f"host discovery script {script!r} is not executable; "
                              f"run: chmod +x {script}")
        self.script = script
        self.timeout_s = timeout_s

    def hosts(self) -> dict[str, int]:
        try:
            out = subprocess.run([self.script], capture_output=True, text=True,
                                 timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"host discovery script {self.script!r} did not finish in "
                              f"{self.timeout_s:g}s") from None
        if out.returncode != 0:
            raise ConfigError(f"host discovery script {self.script!r} exited with "
                              f"{out.returncode}: {out.stderr.strip()[:300]}")
        return parse_host_slots(out.stdout, f"host discovery script {self.script!r}")


def slots_from_resources(available: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    """How many workers fit in `available` resources."""
    fits = [math.floor(available.get(name, 0.0) / need + 1e-9)
            for name, need in per_worker.items() if need > 0]
    return max(0, min(fits)) if fits else 0

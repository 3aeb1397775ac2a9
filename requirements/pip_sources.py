"""Prints the uv options that make uv look where pip is configured to look.

uv reads no pip configuration. On a machine whose pip is pointed at extra indexes or a
find-links folder (a local CPU build of torch, say), `make` passes the same places to uv and
lets uv take the best version across all of them, as pip does. Nothing configured, nothing
printed. The last setting of a key wins, as `pip config list` lists them lowest first and
the environment (PIP_*) last.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links"}


def pip_settings() -> dict[str, str]:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=False).stdout
    settings = {}
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in OPTIONS or name == "cert":
            settings[name] = value.strip().strip("'\"")
    return settings


def uv_options(settings: dict[str, str]) -> list[str]:
    options = []
    for name, flag in OPTIONS.items():
        for value in settings.get(name, "").split():
            options += [flag, value]
    if options:
        options += ["--index-strategy", "unsafe-best-match"]
    return options


if __name__ == "__main__":
    print(shlex.join(uv_options(pip_settings())))

"""This machine's processes, read from /proc (Linux, where Ray clusters run)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process (zombies left out)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue
        if fields[0] != "Z":
            out[int(pid)] = (int(fields[1]), cmd.strip())
    return out


def with_descendants(roots: Iterable[int], procs: dict[int, tuple[int, str]]) -> set[int]:
    """`roots` and every process below them in `procs` (Ray's agents rename themselves, so
    a command line alone does not find them)."""
    found = set(roots)
    grew = True
    while grew:
        children = {p for p, (parent, _) in procs.items() if parent in found} - found
        grew = bool(children)
        found |= children
    return found


def kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to each process; one already gone is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

"""This machine's processes, read from /proc (Linux, where Ray clusters run)."""

from __future__ import annotations

import os


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

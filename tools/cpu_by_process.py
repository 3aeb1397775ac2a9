"""The CPU time every process on the machine spends while a command runs, added up by what
the process is (a Ray actor's class, a Ray daemon, pytest, a script): which processes a
test run's CPU goes to. Processes are read from /proc every half second, so one that lives
less than that is missed or cut short; a Ray worker is counted under the actor it became.

    python tools/cpu_by_process.py -- make test
    python tools/cpu_by_process.py --top 30 -- .venv/bin/python -m pytest tests/integration
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import threading

_HZ = os.sysconf("SC_CLK_TCK")
# what a command line names, first match wins (a raylet's own command line names the
# worker script, so the daemons come first)
_DAEMONS = ("raylet", "gcs_server", "log_monitor", "dashboard/agent", "dashboard.py",
            "runtime_env/agent", "monitor.py", "default_worker")


def kind(cmdline: str) -> str:
    """What a process is, from its command line."""
    if cmdline.startswith("ray::"):
        return cmdline.split()[0].split(".")[0]  # the actor's class, not the method
    for daemon in _DAEMONS:
        if daemon in cmdline:
            return daemon
    if "pytest" in cmdline or "xdist" in cmdline:
        return "pytest"
    words = cmdline.split()
    if words and "python" in os.path.basename(words[0]):
        return "python " + " ".join(words[1:3])[:50] if len(words) > 1 else "python"
    return os.path.basename(words[0]) if words else "?"


def _sample(seen: dict[str, tuple[float, str]]) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / _HZ
            if pid in seen and cpu <= seen[pid][0]:
                continue
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read().replace("\0", " ").strip()
            cmdline = cmdline or stat[stat.index("(") + 1:stat.rindex(")")]
            # a Ray worker keeps the name of the actor it became, even once it exits
            if pid in seen and seen[pid][1].startswith("ray::") \
                    and not cmdline.startswith("ray::"):
                cmdline = seen[pid][1]
            seen[pid] = (cpu, cmdline)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="rows to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[str, tuple[float, str]] = {}
    _sample(seen)
    before = {pid: cpu for pid, (cpu, _) in seen.items()}
    done = threading.Event()

    def sampler() -> None:
        while not done.wait(0.5):
            _sample(seen)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        code = subprocess.call(command)
    finally:
        done.set()
        thread.join()
        _sample(seen)
    total: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for pid, (cpu, cmdline) in seen.items():
        spent = cpu - before.get(pid, 0.0)
        if spent > 0:
            total[kind(cmdline)] += spent
            count[kind(cmdline)] += 1
    # a process whose command line could not be read is named by its 15-character comm
    for short in [k for k in total if len(k) == 15]:
        full = next((k for k in total if k != short and k.startswith(short)), None)
        if full is not None:
            total[full] += total.pop(short)
            count[full] += count.pop(short)
    print(f"\nCPU seconds by process kind, {sum(total.values()):.0f} in all:")
    print(f"{'CPU s':>8} {'processes':>9}  kind")
    for name, spent in total.most_common(args.top):
        print(f"{spent:8.1f} {count[name]:9d}  {name}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())

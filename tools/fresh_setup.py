"""Times the README's two commands as a new user meets them, phase by phase.

A clean clone of this repository's HEAD in a temporary folder, with empty package caches (uv's
and pip's point into that folder), runs `make demo`, with --check `make check` and with
--test `make test`, one make target at a time so each phase has its own time:

    venv + uv     python -m venv, then uv itself (pip)
    install       what the demo imports (uv)
    build         the native core (CMake through scikit-build-core)
    Ray start     from `raytrain-x run`'s "Ray ready in" line
    demo job      the rest of the demo: workers, training, shutdown
    test set-up   the test tools and extras `make test` adds (uv)
    make check    lint and the unit tests, the tier run before each commit
    lint + tests  the rest of `make test` (ruff, import-linter, pytest)

--load N runs N CPU-bound processes (`while True: pass`) beside it all, started before the
clone and killed after, as a shared CI runner would. Afterwards it lists what the run left
behind, as the package's own leak check (`raytrain_x.testing.leaks`, run by the clone's
Python) finds it, and the new entries in the temp dir; any process or segment left fails the
run.

    python tools/fresh_setup.py                       # make demo
    python tools/fresh_setup.py --test                # make demo, then make test
    python tools/fresh_setup.py --check               # make demo, then make check
    python tools/fresh_setup.py --test --load 1 --json loaded.json --logs loaded-logs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "default_worker")  # is Ray running now?

DEMO = [("venv + uv", ".venv/bin/uv"), ("install", ".venv/.demo-deps-stamp"),
        ("build", ".venv/.build-stamp"), ("demo", "demo")]
SET_UP = [("test set-up", ".venv/.test-deps-stamp")]
CHECK = [("make check", "check")]
TEST = [("lint + tests", "test")]


def _ray_processes() -> list[str]:
    """Ray's processes running now (the run must start alone)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, UnicodeDecodeError):
            continue
        if any(name in cmd for name in RAY_PROCESSES):
            found.append(f"{pid} {cmd[:120]}")
    return found


def _snapshot(path: Path) -> None:
    """What runs now, for the clone's own leak check (`raytrain_x.testing.leaks`) to
    compare with: this Python has no raytrain-x to take the snapshot with."""
    path.write_text(json.dumps({"pids": [int(p) for p in os.listdir("/proc") if p.isdigit()],
                                "shm": os.listdir("/dev/shm")}))


def _left_behind(clone: Path, before: Path) -> dict:
    """What the run left (Ray's processes, engine segments), as the package's leak check
    finds it, run by the clone's own Python."""
    out = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-m",
                          "raytrain_x.testing.leaks", str(before)],
                         capture_output=True, text=True, cwd=clone)
    try:  # the check lists only the kinds with something left: the others are empty
        return {"processes": [], "shared memory": [],
                **json.loads(out.stdout.strip().splitlines()[-1])}
    except (ValueError, IndexError):
        return {"the leak check failed": [out.stderr.strip()[-300:]]}


def _run_step(name: str, target: str, clone: Path, env: dict, logs: Path) -> tuple[float, str]:
    log = logs / f"{target.strip('.').replace('/', '_')}.log"
    start = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(["make", target], cwd=clone, env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    text = log.read_text()
    if code != 0:
        sys.exit(f"{name} (make {target}) failed with exit code {code}; last lines of {log}:\n"
                 + "\n".join(text.splitlines()[-30:]))
    print(f"  {name:<14} {seconds:7.1f}s", flush=True)
    return seconds, text


def measure(test: bool, workdir: Path, keep_logs: str | None, check: bool = False) -> dict:
    clone = workdir / "raytrain-x"
    logs = workdir / "logs"
    logs.mkdir()
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = {**os.environ, "UV_CACHE_DIR": str(workdir / "uv-cache"), "PIP_NO_CACHE_DIR": "1",
           "PYTEST_ADDOPTS": "--durations=25"}
    times: dict[str, float] = {}
    steps = DEMO + (SET_UP if test or check else []) + (CHECK if check else []) + \
        (TEST if test else [])
    for name, target in steps:
        try:
            times[name], text = _run_step(name, target, clone, env, logs)
        finally:
            if keep_logs:
                shutil.copytree(logs, keep_logs, dirs_exist_ok=True)
        if name == "demo":
            ray = re.search(r"Ray ready in ([0-9.]+)s", text)
            times["Ray start"] = float(ray.group(1)) if ray else float("nan")
            times["demo job"] = times.pop("demo") - times["Ray start"]
            accuracy = re.search(r"test accuracy ([0-9.]+)", text)
            times["demo accuracy"] = float(accuracy.group(1)) if accuracy else float("nan")
        if name == "lint + tests":
            summary = re.search(r"=+ (.*) in ([0-9.]+)s", text)
            times["tests"] = float(summary.group(2)) if summary else float("nan")
            times["test summary"] = summary.group(1) if summary else "?"
    times["make demo"] = sum(times[k] for k in ("venv + uv", "install", "build", "Ray start",
                                                "demo job"))
    if test:
        times["make test"] = times["test set-up"] + times["lint + tests"]
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", action="store_true", help="also run make test")
    parser.add_argument("--check", action="store_true", help="also run make check")
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside it")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--logs", help="copy each step's output into this folder")
    args = parser.parse_args()
    if _ray_processes():
        sys.exit("Ray is already running here; stop it (ray stop) so the run starts alone")

    tmp_before = set(os.listdir(tempfile.gettempdir()))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.load)]
    print(f"fresh clone of {REPO.name} HEAD, empty package caches, {args.load} busy cores "
          f"beside it, {os.cpu_count()} cores", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="raytrain-x-fresh-") as workdir:
            before = Path(workdir) / "before.json"
            _snapshot(before)
            times = measure(args.test, Path(workdir), args.logs, args.check)
            left = _left_behind(Path(workdir) / "raytrain-x", before)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    left["temp entries"] = sorted(set(os.listdir(tempfile.gettempdir())) - tmp_before)
    for name in ("make demo", "make check", "make test", "test summary"):
        if name in times:
            print(f"{name}: {times[name]:.1f}s" if isinstance(times[name], float)
                  else f"{name}: {times[name]}")
    for what, items in left.items():
        print(f"left behind, {what}: {items or 'none'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": args.load, "times": times,
                                               "left": left}, indent=1))
    return 1 if left.get("processes") or left.get("shared memory") else 0


if __name__ == "__main__":
    sys.exit(main())

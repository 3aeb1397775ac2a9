"""Runs a shell command on every worker of a started executor, streaming its output."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from raytrain_x.common import settings
from raytrain_x.common.horovod_env import worker_env
from raytrain_x.ray.executor import RayExecutor

# after the job's timeout, what a rank that outlived a failed one gets to end by itself
STOP_GRACE_S = 10.0


def run_script(command: list[str], cwd: str | None = None) -> int:
    """Runs `python script.py args` (or `python -m module args`) inside this process, as
    `__main__`; returns its exit code. Used by elastic jobs launched from the CLI. With
    `cwd` (the launcher's folder) it runs there where this node has that folder."""
    import os
    import runpy
    import sys

    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)

    if command and command[0] in ("python", "python3") or command[0] == sys.executable:
        command = command[1:]
    module = command[0] == "-m"
    target = command[1] if module else command[0]
    saved = sys.argv
    sys.argv = command[1:] if module else list(command)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            raise
        return 0
    finally:
        sys.argv = saved
    return 0


def command_env(executor: RayExecutor, rank: int, store_addr: str, store_port: int,
                store_secret: str, hostname: str) -> dict:
    """The rendezvous variables (`settings.LAUNCHER`) `rx.init()` reads in a launched
    process, and horovodrun's (`HOROVOD_RANK`, ..., `HOROVOD_HOSTNAME`: `hostname`, its
    node's address) for scripts that read them."""
    slot = executor.slots[rank]
    values = {settings.RANK: slot.rank, settings.SIZE: len(executor.slots),
              settings.LOCAL_RANK: slot.local_rank, settings.LOCAL_SIZE: slot.local_size,
              settings.CROSS_RANK: slot.cross_rank, settings.CROSS_SIZE: slot.cross_size,
              settings.STORE_ADDR: store_addr, settings.STORE_PORT: store_port,
              settings.STORE_SECRET: store_secret}
    return {**{s.env: str(v) for s, v in values.items()},
            **worker_env(slot.rank, len(executor.slots), slot.local_rank, slot.local_size,
                         slot.cross_rank, slot.cross_size, hostname)}


def run_command_on_workers(executor: RayExecutor, command: list[str], env: dict[str, str],
                           emit: Callable[[int, str], None], cwd: str | None = None) -> list[dict]:
    """Runs `command` on every worker, in `cwd` where a node has that folder;
    `emit(rank, line)` gets each output line.

    Rank 0's process hosts the store the others meet at, on its node's address; it answers
    only processes that prove this job's secret, a fresh one per call, which reaches the
    workers through Ray and each process through its environment. Returns per rank a dict with
    `code`, `ended` (time) and `lost_peer` (it failed only because a peer did); a worker
    whose actor died reports code 1. Once a rank failed, the others get the job's timeout
    and `STOP_GRACE_S` to end (a peer waiting in a collective fails within the timeout); a
    rank still running then (stuck outside any collective) has its worker killed, and its
    command with it, and reports `stopped`.
    """
    rank0 = executor.workers[0]
    addr, port = ray.get([rank0.node_ip.remote(), rank0.free_port.remote()])
    hostnames = ray.get([w.node_ip.remote() for w in executor.workers])
    secret = secrets.token_hex(32)
    results = [{"code": 1, "ended": float("inf"), "lost_peer": False}
               for _ in executor.workers]

    def follow(rank: int) -> None:
        gen = executor.workers[rank].run_command.options(num_returns="streaming").remote(
            command, {**env, **command_env(executor, rank, addr, port, secret,
                                           hostnames[rank])}, cwd)
        try:
            for ref in gen:
                item = ray.get(ref)
                if isinstance(item, dict):
                    results[rank] = item
                else:
                    emit(rank, item)
        except RayActorError:
            if interrupted.is_set():  # the launcher stops the workers: nothing to report
                return
            emit(rank, "raytrain-x: this worker's actor died (node lost or killed)")
            results[rank] = {"code": 1, "ended": time.time(), "lost_peer": False}
        except RayTaskError as exc:  # the launch itself failed on the worker: its cause
            emit(rank, f"raytrain-x: the command could not run: {exc.cause!r}")
            results[rank] = {"code": 1, "ended": time.time(), "lost_peer": False}

    interrupted = threading.Event()
    threads = [threading.Thread(target=follow, args=(r,), daemon=True)
               for r in range(len(executor.workers))]
    for t in threads:
        t.start()
    try:
        _wait_for_ranks(executor, threads, results, emit)
    except KeyboardInterrupt:  # Ctrl-C: the caller stops the workers, quietly
        interrupted.set()
        raise
    return results


def _wait_for_ranks(executor: RayExecutor, threads: list[threading.Thread],
                    results: list[dict], emit: Callable[[int, str], None]) -> None:
    """Until every rank's command ended; once one failed, the others get the job's timeout
    and `STOP_GRACE_S`, then their workers are killed."""
    deadline = float("inf")
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=0.2)
        failed = any(r["code"] not in (0, None) and not t.is_alive()
                     for r, t in zip(results, threads))
        if failed and deadline == float("inf"):
            deadline = time.monotonic() + executor.settings.timeout_s + STOP_GRACE_S
        if time.monotonic() > deadline:
            for rank, t in enumerate(threads):
                if t.is_alive():
                    emit(rank, "raytrain-x: still running after another rank failed; "
                               "stopping it")
                    ray.kill(executor.workers[rank], no_restart=True)
                    t.join(timeout=30)
                    results[rank] = {"code": 1, "ended": time.time(), "lost_peer": True,
                                     "stopped": True}
            break

"""Runs a function on N real processes joined by real gloo groups (no Ray needed)."""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import secrets
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import forkserver
from typing import Any
from unittest import mock

import torch.multiprocessing as mp

from raytrain_x.testing.waiting import free_port
from tests.limits import limit

# Ranks start as forks of a server that has imported torch once (a fresh interpreter per rank
# spent about 2 s of CPU importing it, for each of the suite's ~100 worker runs), and
# torch._dynamo: torch imports it the first time an optimizer is built, about 1.4 s of CPU
# more for every rank that builds one. Not raytrain-x itself: a rank checks which of its faces
# it loads. Each rank still is a new process with the caller's environment as it is at the
# call.
_CONTEXT = mp.get_context("forkserver")
_PRELOAD = ["torch", "torch._dynamo", "numpy", "pytest", "tests.limits"]
_CONTEXT.set_forkserver_preload(_PRELOAD)


@contextmanager
def preloaded(*modules: str, env: dict | None = None) -> Iterator[None]:
    """Inside the block, ranks fork from a server that has also imported `modules`, started
    with `env` added (TensorFlow reads TF_CPP_MIN_LOG_LEVEL when it loads): a TensorFlow
    rank spent about 8 s of CPU importing it, for each of some thirty ranks. Outside it,
    ranks fork from the torch-only server again, so no other test's ranks carry them.
    RAYTRAIN_X_TEST_PRELOAD=0 leaves the server as it is (to measure what this saves)."""
    if os.environ.get("RAYTRAIN_X_TEST_PRELOAD") == "0":
        yield
        return
    _restart_fork_server([*_PRELOAD, *modules], env or {})
    try:
        yield
    finally:
        stop_fork_server()  # the next run starts the plain one
        _CONTEXT.set_forkserver_preload(_PRELOAD)


def _restart_fork_server(modules: list[str], env: dict) -> None:
    stop_fork_server()
    _CONTEXT.set_forkserver_preload(modules)
    with mock.patch.dict(os.environ, env):
        forkserver.ensure_running()  # it inherits this environment now


def stop_fork_server() -> None:
    """Stops the fork server ranks start from (it lives until its parent exits otherwise);
    the next run starts one again."""
    forkserver._forkserver._stop()  # noqa: SLF001 - the stdlib's own way to stop it


def _entry(rank: int, size: int, port: int, fn: Callable, args: tuple, env: dict, hosts: int,
           queue: Any) -> None:
    os.environ.clear()  # the caller's environment, not the fork server's
    os.environ.update({k: str(v) for k, v in env.items()})
    per_host = size // hosts
    os.environ.update({
        "RAYTRAIN_X_RANK": str(rank),
        "RAYTRAIN_X_SIZE": str(size),
        "RAYTRAIN_X_LOCAL_RANK": str(rank % per_host),
        "RAYTRAIN_X_LOCAL_SIZE": str(per_host),
        "RAYTRAIN_X_CROSS_RANK": str(rank // per_host),
        "RAYTRAIN_X_CROSS_SIZE": str(hosts),
        "RAYTRAIN_X_STORE_ADDR": "127.0.0.1",
        "RAYTRAIN_X_STORE_PORT": str(port),
    })
    os.environ.setdefault("RAYTRAIN_X_TIMEOUT", "20")
    try:
        import torch

        torch.set_num_threads(1)
        # plain pickle: tensors travel by value, not as shared-memory handles of a dead process
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            import raytrain_x.core.runtime as runtime

            runtime.shutdown()
        except Exception:  # noqa: BLE001
            pass


# what rank 0 says when the port picked for its store was taken before it could listen
# (another test's process, between `free_port` and the bind): the ranks are started again
# on a new port, once
PORT_TAKEN = "could not listen on"


def run_workers(fn: Callable, size: int, *args: Any, env: dict | None = None, hosts: int = 1,
                work_s: float = 30.0, allow_failures: bool = False) -> list[Any]:
    """Runs `fn(*args)` on `size` new processes; returns per-rank results in rank order.

    `work_s` is what the whole run takes on an idle runner (tests/limits.py makes the limit).
    With `allow_failures`, a failed rank's entry is the exception text instead of raising.
    A run whose store port was taken before rank 0 listened (`PORT_TAKEN`) runs again once.
    """
    for attempt in (1, 2):
        results, failures = _run_once(fn, size, args, env, hosts, work_s)
        if attempt == 1 and any(PORT_TAKEN in text for text in failures.values()):
            continue
        break
    if failures and not allow_failures:
        raise AssertionError("\n".join(f"rank {r} failed: {t}"
                                       for r, t in sorted(failures.items())))
    return [pickle.loads(results[r]) if r in results else failures[r] for r in range(size)]


def _run_once(fn: Callable, size: int, args: tuple, env: dict | None, hosts: int,
              work_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """One run of `run_workers`: each rank's result, and each failed rank's error."""
    ctx = _CONTEXT
    queue = ctx.Queue()
    port = free_port()
    # the world's store answers only its own ranks (raytrain_x.comm.job_store)
    env = {**os.environ, "RAYTRAIN_X_STORE_SECRET": secrets.token_hex(16), **(env or {})}
    procs = [ctx.Process(target=_entry, args=(r, size, port, fn, args, env, hosts, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    seconds = limit(work_s)
    deadline = time.monotonic() + seconds
    try:
        while len(results) + len(failures) < size:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"gave up after {seconds:.0f}s waiting for ranks "
                    f"{sorted(set(range(size)) - set(results) - set(failures))} of "
                    f"{fn.__name__} to finish; done: {sorted(results)}, failed: "
                    f"{sorted(failures)}")
            try:
                rank, ok, value = queue.get(timeout=0.2)
                (results if ok else failures)[rank] = value
            except queue_module.Empty:
                for r, p in enumerate(procs):  # a rank that died without reporting
                    if not p.is_alive() and r not in results and r not in failures \
                            and queue.empty():
                        failures[r] = f"process exited with code {p.exitcode} without a result"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return results, failures

"""Waits that say what they waited for, and free ports: the harness's small pieces, shared
by the tests (`tests/limits.py` scales the limits), the soak and the benchmarks."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               state: Callable[[], object] | None = None, poll_s: float = 0.05) -> None:
    """Polls `condition` until it holds; past `timeout_s`, raises AssertionError naming
    `what` it waited for and, with `state`, what it saw last.

    Args:
        condition: returns True once the wait is over.
        timeout_s: how long to wait.
        what: what is waited for, as the error names it.
        state: what was seen, for the error.
        poll_s: seconds between two looks.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            seen = f"; last seen: {state()}" if state is not None else ""
            raise AssertionError(f"gave up after {timeout_s:.0f}s waiting for {what}{seen}")
        time.sleep(poll_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the OS's pick).

    Args:
        host: the address to bind (loopback, or an emulated host's).
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

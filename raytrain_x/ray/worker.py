"""The Ray actor that hosts one worker (one rank)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray

from raytrain_x.comm.rendezvous import Rendezvous
from raytrain_x.comm.store import ActorStore, call_actor
from raytrain_x.common import settings
from raytrain_x.common.errors import LOST_PEER_EXIT_CODE
from raytrain_x.common.horovod_env import worker_env
from raytrain_x.ray import metrics
from raytrain_x.ray.failures import WorkerFailure

_INITS_PER_ROUND = 1_000_000  # a static round's key spaces: round * this + its nth init()

log = logging.getLogger("raytrain_x.worker")


class LeaveJob(BaseException):  # noqa: N818 - a signal like SystemExit, not an error
    """Raised in a worker the elastic driver asked to leave: its node is draining. A
    BaseException, so a user's `except Exception` does not keep the worker in the job."""


@dataclass
class Left:
    """What `execute` returns for a worker that left the job at a commit."""

    reason: str


class ActorAdvisor:
    """Rank 0's client of the `AutotuneController` actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def begin(self, searched: list[str]) -> list[str]:
        return ray.get(self.actor.begin.remote(searched))

    def report(self, score: float) -> dict[str, Any]:
        return ray.get(self.actor.report.remote(score))


def install_world(rdv: dict[str, Any], store_actor: Any, env: dict[str, str],
                  autotune_actor: Any, next_round: Callable[[], int]) -> None:
    """In a worker process: sets `env` and installs the rendezvous of a fixed world, so that
    `rx.init()` meets the other ranks through `store_actor` in the key space `next_round()`
    gives (every rank must count alike); rank 0 gets the autotune controller's client."""
    from raytrain_x.core import runtime

    os.environ.update(env)
    if autotune_actor is not None:
        runtime.set_autotune_advisor_factory(
            lambda config, start, fixed: ActorAdvisor(autotune_actor))
    address = ray.util.get_node_ip_address()
    os.environ.update(_horovod_env(rdv, address))

    def provider() -> Rendezvous:
        return Rendezvous(store=ActorStore(store_actor, rdv["timeout_s"]), round=next_round(),
                          address=address, **rdv)

    runtime.set_rendezvous_provider(provider)


def _horovod_env(place: dict[str, Any], address: str) -> dict[str, str]:
    """horovodrun's worker variables for this worker's place in the round."""
    return worker_env(place.get("rank", 0), place.get("size", 1), place.get("local_rank", 0),
                      place.get("local_size", 1), place.get("cross_rank", 0),
                      place.get("cross_size", 1), address)


# How often a worker looks whether its node's raylet is still its parent.
RAYLET_POLL_S = 0.5


def _is_raylet(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0]
    except OSError:  # not Linux, or the process is gone
        return False
    return os.path.basename(argv0) == b"raylet"


def exit_with_raylet(poll_s: float = RAYLET_POLL_S) -> threading.Thread | None:
    """In a worker process its node's raylet started: a daemon thread that ends the process
    once the raylet is gone (the process's parent changes). Ray leaves such a worker
    running, answering its callers and training with its peers, until the GCS's health
    checks declare the node dead (16 s with Ray's defaults, `tools/raylet_kill.py`),
    and after that too: an orphan no `ray.kill` reaches (a kill goes through the raylet),
    holding its memory and devices. Gone at once, its peers lose it at their next
    collective and the elastic job re-forms without it. None where the parent is not a
    raylet (a plain process, a driver)."""
    parent = os.getppid()
    if not _is_raylet(parent):
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("raytrain-x worker %d: the node's raylet (pid %d) is gone; exiting",
                    os.getpid(), parent)
        os._exit(1)

    thread = threading.Thread(target=watch, name="raytrain-x-raylet-watch", daemon=True)
    thread.start()
    return thread


def die_with_parent() -> None:
    """In a child between fork and exec: the kernel sends it SIGKILL when the thread that
    started it ends (Linux's PR_SET_PDEATHSIG), so a launched script never outlives its
    worker, whose collectives and GPU it would hold."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class WorkerActor:
    """Runs user functions and commands for one rank (the plain class behind `Worker`)."""

    def __init__(self) -> None:
        exit_with_raylet()
        self.executable: Any = None
        self.rank = -1
        self.round_id = 0
        self.inits = 0  # rx.init() calls in the current round
        self.joining_since: float | None = None  # in its elastic rendezvous call since
        self.execute_thread: int | None = None  # the thread `execute` runs the job on
        self.status_file: str | None = None  # where a command `run_command` runs writes
        self.metrics: metrics.ExportThread | None = None

    def _read_status(self) -> dict[str, Any] | None:
        """This rank's status (`core.status.snapshot`): from the process `run_command`
        started while one runs, else from this process once `rx.init()` has run here."""
        if self.status_file is not None:
            from raytrain_x.core import status

            return status.read_status_file(self.status_file)
        return metrics.rank_status()

    def _start_metrics(self) -> None:
        """Exports this rank's metrics from now on (once per actor; not where they are
        turned off)."""
        self.metrics = metrics.export_this_process(self._read_status,
                                                   settings.JOB_NAME.read(),
                                                   self.node_id()[:8])

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def gpu_ids(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, rdv: dict[str, Any], store_actor: Any, env: dict[str, str],
              autotune_actor: Any = None) -> None:
        """Sets the environment and installs the rendezvous `rx.init()` will use (and, with
        autotune, the client of the executor's controller actor)."""
        self.rank = rdv["rank"]

        def next_round() -> int:
            # each run()/execute() is a new round, so a world re-formed after a failure
            # never reads the keys of the one before; and each init() within one (after a
            # shutdown()) gets its own key space too: every rank counts its inits alike
            self.inits += 1
            return self.round_id * _INITS_PER_ROUND + self.inits

        install_world(rdv, store_actor, env, autotune_actor, next_round)
        self._start_metrics()

    def setup_elastic(self, worker_id: str, rounds_actor: Any, store_actor: Any,
                      timeout_s: float, env: dict[str, str], autotune_actor: Any = None) -> None:
        """Elastic worker: every `rx.init()` joins the next round the driver forms."""
        from raytrain_x.core import runtime

        os.environ.update(env)
        if autotune_actor is not None:  # whoever becomes rank 0 reports to the controller
            runtime.set_autotune_advisor_factory(
                lambda config, start, fixed: ActorAdvisor(autotune_actor))

        def provider() -> Rendezvous:
            from raytrain_x.elastic.state import state_round

            self.joining_since = time.monotonic()
            try:
                place = call_actor(rounds_actor.join, worker_id, state_round())
            finally:
                self.joining_since = None
            if place.get("leave"):
                raise LeaveJob(place["reason"])
            self.rank = place["rank"]
            rdv = Rendezvous(store=ActorStore(store_actor, timeout_s), timeout_s=timeout_s,
                             address=self.node_ip(), **place)
            os.environ.update(_horovod_env(vars(rdv), rdv.address))  # this round's place
            return rdv

        runtime.set_rendezvous_provider(provider)
        # rank 0 asks at every commit; the driver learns the job has progress to lose, and
        # that this round has formed
        runtime.set_host_update_probe(
            lambda: call_actor(rounds_actor.commit, runtime.rendezvous().round))
        self._start_metrics()

    def create_executable(self, cls: type, args: tuple, kwargs: dict) -> None:
        self.executable = cls(*args, **kwargs)

    def execute(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                with_executable: bool = False, round_id: int = 0) -> Any:
        """Runs `fn(*args, **kwargs)`, or `fn(executable)` with `with_executable`, in
        rendezvous round `round_id`; on failure shuts this rank's engine down so its peers
        are released."""
        self.round_id = round_id
        self.inits = 0
        self.execute_thread = threading.get_ident()
        try:
            if with_executable:
                return fn(self.executable)
            return fn(*args, **(kwargs or {}))
        except LeaveJob as exc:
            from raytrain_x.core import runtime

            runtime.shutdown()
            return Left(str(exc))
        except BaseException as exc:
            from raytrain_x.core import runtime

            runtime.shutdown()
            if isinstance(exc, SystemExit):
                raise
            raise WorkerFailure.from_exception(exc, traceback.format_exc()) from None

    def run_command(self, command: list[str], env: dict[str, str],
                    cwd: str | None = None) -> Iterator[Any]:
        """Runs a command, yielding its output lines and finally a dict with its exit code,
        when it ended (this node's clock) and whether it only failed because a peer did (a
        raytrain-x process that ends on a lost peer exits with `LOST_PEER_EXIT_CODE`).

        It runs in `cwd` (the launcher's folder, as horovodrun runs a command in the same
        folder on every host) where this node has that folder, else in the worker's own.
        It goes with this worker: the kernel kills it when this process ends (its raylet
        died, the actor was killed), and its process group when the call ends early.
        Output bytes that are not UTF-8 are shown escaped (`\\xff`), never lost."""
        if command and command[0] in ("python", "python3"):
            command = [sys.executable, *command[1:]]  # the interpreter Ray runs us with
        # the command's rank writes its status there; this actor exports it
        fd, self.status_file = tempfile.mkstemp(prefix="rtx-status-", suffix=".json")
        os.close(fd)
        try:
            try:
                proc = subprocess.Popen(
                    command, env={**os.environ, **env, "PYTHONUNBUFFERED": "1",
                                  settings.LAUNCHED.env: "1",
                                  settings.STATUS_FILE.env: self.status_file},
                    cwd=cwd if cwd and os.path.isdir(cwd) else None,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=die_with_parent)
            except OSError as exc:  # not found, not executable: the shell's one line and code
                yield f"raytrain-x: cannot run {command[0]!r}: {exc.strerror}"
                yield {"code": 127 if isinstance(exc, FileNotFoundError) else 126,
                       "ended": time.time(), "lost_peer": False}
                return
            assert proc.stdout is not None
            try:
                for raw in proc.stdout:
                    yield raw.decode("utf-8", "backslashreplace").rstrip("\n")
                code = proc.wait()
            finally:
                if proc.poll() is None:  # the call ended early (cancelled, closed)
                    _kill_group(proc.pid)
                    proc.wait()
            if self.metrics is not None:
                self.metrics.once()  # its last status, written as it exited
        finally:
            os.unlink(self.status_file)
            self.status_file = None
        yield {"code": code, "ended": time.time(), "lost_peer": code == LOST_PEER_EXIT_CODE}

    @ray.method(concurrency_group="probe")
    def status(self) -> dict[str, Any] | None:
        """This rank's status now (`core.status.snapshot`; None before it has one): the
        driver's progress line reads it."""
        return self._read_status()


    @ray.method(concurrency_group="probe")
    def pid(self) -> int:
        """This worker's process id (fault injection kills it with a real SIGKILL)."""
        return os.getpid()

    @ray.method(concurrency_group="probe")
    def heartbeat(self) -> tuple[float, int, float, int]:
        """The elastic driver's probe, answered at once like `ping`: the seconds this worker
        has been in its call to join the next round (0: not in one), which the driver
        compares with the joins the rounds actor received (a call Ray holds back never
        arrives); the round of the state it holds (`elastic.state.state_round`), which
        tells the driver it holds the job's state before its next join can say so; and its
        own work per step in this world and over how many steps (`StepClock.work`), which
        the driver's policies compare between workers."""
        from raytrain_x.common.process import PROCESS
        from raytrain_x.elastic.state import state_round

        since = self.joining_since
        # in a join, the last world's work is over (the next world measures its own)
        work_s, work_steps = PROCESS.steps.work() if since is None else (0.0, 0)
        return ((0.0 if since is None else time.monotonic() - since), state_round(),
                work_s, work_steps)

    @ray.method(concurrency_group="probe")
    def where(self, frames: int = 4) -> str:
        """Where the job's thread is now: its innermost `frames` frames (the driver names
        them when it fails a worker that stays away from the rendezvous)."""
        frame = sys._current_frames().get(self.execute_thread or -1)
        if frame is None:
            return "not running the job"
        return " <- ".join(
            f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
            for f in reversed(traceback.extract_stack(frame)[-frames:]))

    @ray.method(concurrency_group="probe")
    def ping(self) -> bool:
        """Answers at once, even while `execute` runs (its own thread): the driver tells a
        busy worker from an unreachable one with it."""
        return True


# "probe" has a thread of its own; every other method runs in order on the default one.
# A subclass of WorkerActor becomes an actor class with `ray.remote(**WORKER_OPTIONS)`.
WORKER_OPTIONS = {"concurrency_groups": {"probe": 1}}
Worker = ray.remote(**WORKER_OPTIONS)(WorkerActor)

"""What the elastic controller acts through: the worker pool, the cluster view, the rounds
and store clients, and the clocks. `ray_parts` wires them to Ray (production);
`raytrain_x.testing.simulation` wires simulated ones, so the same controller runs on a
virtual clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from raytrain_x.comm.store_actor import StoreActor, control_concurrency
from raytrain_x.common.errors import ControlActorLost
from raytrain_x.elastic.checkpoints import latest_checkpoint
from raytrain_x.ray.elastic.cluster import ClusterView
from raytrain_x.ray.elastic.pool import WorkerPool
from raytrain_x.ray.elastic.rounds import ElasticRounds
from raytrain_x.ray.elastic.settings import ElasticSettings
from raytrain_x.ray.placement import stable_node_strategy

# how long the driver waits for the rounds actor to answer one call: its calls return at
# once (a join parks, the driver's never do), so one that takes this long will not come
CONTROL_CALL_TIMEOUT_S = 60.0
# the longest the rounds actor holds the driver's watch for a join (`watch_joins`); the
# driver sends another at its next look that finds the round still waiting
JOIN_WATCH_S = 10.0


class RoundsClient:
    """The controller's side of the `ElasticRounds` actor: each call waits for its answer."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor  # handed to workers, which join rounds through it
        # the last `next_join` call sent: how many it waits for, its ref and future
        self._join_watch: tuple[int, Any, Any] | None = None

    def _get(self, method: str, *args: Any, timeout: float = CONTROL_CALL_TIMEOUT_S) -> Any:
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except RayActorError as exc:
            raise ControlActorLost(control_lost_message("rounds", exc)) from None
        except GetTimeoutError:
            raise ControlActorLost(
                f"the elastic rounds actor did not answer the driver's {method}() within "
                f"{timeout:.0f} s (its node is cut off or overloaded)") from None

    def waiting(self) -> list[str]:
        return self._get("waiting")

    def watch_joins(self, at_least: int, wake: Callable[[], None]) -> None:
        """Calls `wake` (from Ray's thread) once `at_least` workers wait to join, or after
        `JOIN_WATCH_S`. A call out for the same number is not sent again; one for another
        number ends by itself (its count reached, or its time up) and wakes the driver for
        a look that costs nothing else."""
        if self._join_watch is not None and self._join_watch[0] == at_least and \
                not self._join_watch[2].done():
            return
        ref = self.actor.next_join.remote(at_least, JOIN_WATCH_S)
        self._join_watch = (at_least, ref, ref.future())
        self._join_watch[2].add_done_callback(lambda _: wake())

    def committed_round(self) -> int:
        return self._get("committed_round")

    def committed(self) -> bool:
        return self._get("committed")

    def holders(self) -> list[str]:
        return self._get("holders")

    def hosts_version(self) -> int:
        return self._get("hosts_version")

    def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        self._get("publish", assignments)

    def bump_hosts(self) -> int:
        return self._get("bump_hosts")

    def ask_checkpoint(self) -> None:
        self._get("ask_checkpoint")

    def fail(self, message: str) -> None:
        self._get("fail", message, timeout=5)


class StoreClient:
    """The controller's side of the rendezvous store actor: it gives rounds up, and is
    asked now and then whether it still answers (`check_alive`)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor  # handed to workers, which meet through it
        self._probe: Any = None

    def abandon(self, prefix: str) -> None:
        """Answers every wait under `prefix` at once (not waited for)."""
        self.actor.abandon.remote(prefix)

    def forget(self, prefix: str) -> None:
        """Deletes every key under `prefix` (not waited for)."""
        self.actor.delete_prefix.remote(prefix)

    def check_alive(self) -> None:
        """Raises `ControlActorLost` once the store actor has died; never waits (the answer
        to the last probe is read when it is there, and the next probe sent)."""
        if self._probe is not None:
            ready, _ = ray.wait([self._probe], timeout=0)
            if not ready:
                return
            try:
                ray.get(self._probe)
            except RayActorError as exc:
                raise ControlActorLost(control_lost_message("store", exc)) from None
        self._probe = self.actor.check.remote([])


def control_lost_message(which: str, cause: Any) -> str:
    """The message of a `ControlActorLost`."""
    reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return (f"the job's {which} actor on the head node died ({reason}); no round can form "
            "without it, so every worker was ended. A job with a CheckpointConfig starts "
            "again from its latest complete checkpoint; give the job one to outlive this")


@dataclass
class JobParts:
    pool: Any  # a `WorkerPool`
    cluster: Any  # a `ClusterView`
    rounds: Any  # a `RoundsClient`
    store: Any  # a `StoreClient`
    sleep: Callable[[float], None]  # waits on the job's clock
    wall_clock: Callable[[], float]  # time.time(): drain deadlines are wall-clock times
    close: Callable[[], None]  # ends the rounds and store actors
    # the latest complete durable checkpoint, as the driver describes it (`number` None:
    # none); only asked when the job has a `CheckpointConfig`
    latest_checkpoint: Callable[[], dict[str, Any]] = lambda: {"number": None}
    # the message of a `ControlActorLost` when the rounds or store actor has died, else
    # None: asked when the job fails, whose cause their death may be (a worker's call)
    control_lost: Callable[[], str | None] = lambda: None


def ray_parts(settings: ElasticSettings, clock: Callable[[], float]) -> JobParts:
    """The production wiring: Ray actors, Ray's view of the cluster, real time."""
    # The job's own actors live on the head node: worker nodes may vanish at any time.
    here = stable_node_strategy()
    calls = control_concurrency(settings.max_workers)
    rounds = ElasticRounds.options(scheduling_strategy=here, max_concurrency=calls).remote()
    store = StoreActor.options(scheduling_strategy=here, max_concurrency=calls).remote()

    def close() -> None:
        for actor in (rounds, store):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - it may be gone already
                pass

    def latest() -> dict[str, Any]:
        return latest_checkpoint(settings.checkpoint) if settings.checkpoint else \
            {"number": None}

    def control_lost() -> str | None:
        for which, call in (("rounds", rounds.committed_round), ("store", store.check)):
            try:
                ray.get(call.remote(*([] if which == "rounds" else [[]])), timeout=10)
            except RayActorError as exc:
                return control_lost_message(which, exc)
            except ray.exceptions.GetTimeoutError:
                continue  # slow, not dead
        return None

    return JobParts(WorkerPool(settings, clock), ClusterView(settings), RoundsClient(rounds),
                    StoreClient(store), time.sleep, time.time, close, latest, control_lost)

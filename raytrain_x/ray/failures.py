"""What a failed worker reports, and which failure of several started it.

A worker classifies its own failure by exception type before the traceback becomes text:
a rank that raised `InternalError` or `RendezvousTimeout` only lost a peer. The driver then
reports the earliest rank that failed for another reason (the root cause).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

import ray
from ray.exceptions import RayActorError

from raytrain_x.common.errors import LOST_PEER_ERRORS, ElasticStateLost, WorkerError
from raytrain_x.common.settings import JOIN_HELD_S, PROBE_TIMEOUT_S, short_node

K = TypeVar("K", bound=Hashable)


class WorkerFailure(Exception):
    """A worker's failure as it crosses to the driver: the traceback as plain text (user
    exceptions may not unpickle), whether the worker only lost a peer, and the message of
    an `ElasticStateLost` it raised (the elastic driver stops the job with it)."""

    def __init__(self, traceback_text: str, lost_peer: bool,
                 state_lost: str | None = None) -> None:
        super().__init__(traceback_text)
        self.traceback_text = traceback_text
        self.lost_peer = lost_peer
        self.state_lost = state_lost

    def __reduce__(self):
        return (WorkerFailure, (self.traceback_text, self.lost_peer, self.state_lost))

    @staticmethod
    def from_exception(exc: BaseException, traceback_text: str) -> WorkerFailure:
        return WorkerFailure(traceback_text, isinstance(exc, LOST_PEER_ERRORS),
                             str(exc) if isinstance(exc, ElasticStateLost) else None)


def worker_error(rank: int, exc: Exception) -> WorkerError:
    """The driver's view of a failed remote call (a `RayTaskError` or `RayActorError`)."""
    if isinstance(exc, WorkerError):
        return exc
    if isinstance(exc, RayActorError):
        return WorkerError(rank, "the worker process exited (sys.exit, a crash or a killed "
                                 "node); its output is in the Ray logs", process_lost=True)
    cause = getattr(exc, "cause", None)
    if isinstance(cause, WorkerFailure):
        return WorkerError(rank, cause.traceback_text, cause.lost_peer,
                           state_lost=cause.state_lost)
    return WorkerError(rank, str(exc))


def root_cause_order(lost_peer: bool, rank: int, ended: float = 0.0) -> tuple:
    """The one rule that picks, among failed ranks, the one whose failure started it (for
    the executor and for `raytrain-x run` alike): a rank that did not only lose a peer
    before one that did, then the earliest to end (where known), then the lowest rank."""
    return (lost_peer, ended, rank)


def root_cause(errors: dict[int, WorkerError]) -> WorkerError:
    """The failure that started it (`root_cause_order`), naming the ranks that stopped
    because of it."""
    chosen = min(errors.values(), key=lambda e: root_cause_order(e.lost_peer, e.rank))
    others = sorted(r for r in errors if r != chosen.rank)
    if others:
        chosen = WorkerError(chosen.rank, chosen.detail.rstrip() +
                             f"\n(ranks {others} stopped because of this failure)",
                             chosen.lost_peer)
    return chosen


def ask(workers: Mapping[K, Any], method: str = "ping",
        timeout_s: float = PROBE_TIMEOUT_S) -> tuple[dict[K, Any], set[K]]:
    """Calls `method` (one on the worker's probe thread) of every worker actor at once:
    (the answers of those that answered within `timeout_s`, those that answered with an
    error: their process is gone)."""
    refs = {getattr(worker, method).remote(): key for key, worker in workers.items()}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs \
        else ([], [])
    answers, errors = {}, set()
    for ref in ready:
        try:
            answers[refs[ref]] = ray.get(ref)
        except Exception:  # noqa: BLE001 - any error: the worker is not there to train
            errors.add(refs[ref])
    return answers, errors


def unreachable(workers: Mapping[K, Any], timeout_s: float = PROBE_TIMEOUT_S) -> set[K]:
    """The keys of `workers` (worker actors) that do not answer a ping within `timeout_s`:
    their node is partitioned off or lost. Those that answer with an error (their process
    is gone) are left to Ray's own report of the death, which says more."""
    answers, errors = ask(workers, "ping", timeout_s)
    return set(workers) - set(answers) - errors


def stuck_error(ranks: list[int], nodes: list[str], waited_s: float,
                where: Mapping[int, str] | None = None) -> dict[int, WorkerError]:
    """The errors of ranks that answer a probe but stayed away from the rendezvous their
    peers waited at (`StragglerRule`), with where each was (`WorkerActor.where`)."""
    detail = (f"ranks {ranks} answer but stayed away from the rendezvous for {waited_s:.0f}s "
              f"while their peers waited there (nodes {sorted(short_node(n) for n in set(nodes))}"
              "): a call of theirs to the job's actors is held up (after a network partition "
              "Ray can hold one for minutes) or their training function is stuck; restarted")
    detail += "".join(f"; rank {rank} was in {at}" for rank, at in sorted((where or {}).items()))
    return {rank: WorkerError(rank, detail, process_lost=True) for rank in ranks}


def held_join_error(ranks: list[int], nodes: list[str]) -> dict[int, WorkerError]:
    """The errors of ranks whose call to join a round Ray holds back."""
    detail = (f"ranks {ranks} have been in their call to join the next round for "
              f"{JOIN_HELD_S:.0f}s or more, and the driver's rounds actor never received it "
              f"(nodes {sorted(short_node(n) for n in set(nodes))}): Ray holds back a "
              "worker's calls to an actor it lost touch with, e.g. across a network "
              "partition, for a minute or more; restarted")
    return {rank: WorkerError(rank, detail, process_lost=True) for rank in ranks}


def node_addresses() -> dict[str, str]:
    """Node id -> the node's address, for every node Ray knows."""
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def unreachable_error(ranks: list[int], nodes: list[str], after: str,
                      addresses: Mapping[str, str]) -> dict[int, WorkerError]:
    """The errors of ranks found unreachable, naming them all and their nodes
    (`addresses`: node id -> address, `node_addresses()`)."""
    where = ", ".join(f"{addresses.get(n, '?')} (node {short_node(n)})"
                      for n in sorted(set(nodes)))
    detail = (f"ranks {ranks} are unreachable: no answer within {PROBE_TIMEOUT_S:.0f}s "
              f"{after}; their host {where} is cut off by a network partition or lost, or "
              "their process is gone")
    return {rank: WorkerError(rank, detail, process_lost=True) for rank in ranks}

"""Elastic rounds: the actor workers wait in for the driver to form each round, and how a
round's ranks are assigned (pure logic)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import ray

from raytrain_x.common.errors import ElasticJobStopped
from raytrain_x.ray.placement import assign_ranks


@ray.remote(num_cpus=0)
class ElasticRounds:
    """Rendezvous rounds and the host-set version (asyncio: many workers wait at once)."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future] = {}
        self._hosts_version = 0
        self._error: str | None = None
        self._committed_round = 0  # the last round rank 0 committed in (rounds count from 1)
        self._state_rounds: dict[str, int] = {}  # worker -> the round of the state it holds
        self._checkpoint_asked = False  # the driver wants the next commit written durably
        # the driver's `next_join` calls: how many each waits for, and its future
        self._join_watchers: list[tuple[int, asyncio.Future]] = []

    async def join(self, worker_id: str, state_round: int = 0) -> dict[str, Any]:
        """Blocks until the driver puts this worker in a round; returns its place.
        `state_round`: the round whose state the worker holds (`elastic.state.state_round`;
        0: none, it never synced)."""
        if self._error:
            raise ElasticJobStopped(self._error)
        self._state_rounds[worker_id] = int(state_round)
        future = asyncio.get_running_loop().create_future()
        self._waiting[worker_id] = future
        self._wake_watchers()
        return await future

    async def waiting(self) -> list[str]:
        return list(self._waiting)

    async def next_join(self, at_least: int, wait_s: float) -> int:
        """Returns once `at_least` workers wait to join (at once if they do), the job
        stops, or `wait_s` passes; returns how many wait. The driver keeps such a call out
        while a round waits for its workers, for as many as its decision waits for, and
        looks again as it returns: the round forms as its last worker joins, not at the
        driver's next look, and a round of thousands costs the driver a look or two, not
        one a join."""
        if len(self._waiting) < at_least and not self._error:
            watcher = asyncio.get_running_loop().create_future()
            self._join_watchers.append((at_least, watcher))
            try:
                await asyncio.wait_for(watcher, wait_s)
            except asyncio.TimeoutError:
                pass
            finally:
                self._join_watchers = [w for w in self._join_watchers if w[1] is not watcher]
        return len(self._waiting)

    def _wake_watchers(self, stopped: bool = False) -> None:
        """Ends the watches whose count is reached (every one: `stopped`)."""
        count, left = len(self._waiting), []
        for at_least, watcher in self._join_watchers:
            if stopped or count >= at_least:
                if not watcher.done():
                    watcher.set_result(None)
            else:
                left.append((at_least, watcher))
        self._join_watchers = left

    async def publish(self, assignments: dict[str, dict[str, Any]]) -> None:
        for worker_id, place in assignments.items():
            future = self._waiting.pop(worker_id, None)
            if future is not None and not future.done():
                future.set_result(place)

    async def fail(self, message: str) -> None:
        """Ends the job: every waiting and future join raises `message`."""
        self._error = message
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ElasticJobStopped(message))
        self._waiting.clear()
        self._wake_watchers(stopped=True)

    async def bump_hosts(self) -> int:
        self._hosts_version += 1
        return self._hosts_version

    async def hosts_version(self) -> int:
        return self._hosts_version

    async def ask_checkpoint(self) -> None:
        """Rank 0 writes its next commit to durable storage (a drain of every holder)."""
        self._checkpoint_asked = True

    async def commit(self, round_id: int) -> tuple[int, bool]:
        """Rank 0 committed in round `round_id`: the job has progress to lose, and that
        round has formed. Returns the host-set version, which it checks at each commit,
        and whether the driver asked for a durable checkpoint (told once)."""
        self._committed_round = max(self._committed_round, round_id)
        asked, self._checkpoint_asked = self._checkpoint_asked, False
        return self._hosts_version, asked

    async def committed_round(self) -> int:
        """The last round rank 0 committed in (0: none yet); a later round is still
        forming (its rendezvous or its state sync)."""
        return self._committed_round

    async def committed(self) -> bool:
        """Whether the job ever committed."""
        return self._committed_round > 0

    async def holders(self) -> list[str]:
        """The workers that hold the job's latest committed state (`current_holders`)."""
        return current_holders(self._state_rounds, self._committed_round)


def current_holders(state_rounds: dict[str, int], committed_round: int) -> list[str]:
    """The workers whose state, as they reported it when they last joined a round, is the
    job's latest: from a round no older than the last that committed (a worker that left
    a round which committed after it holds an older state)."""
    return sorted(w for w, r in state_rounds.items() if r > 0 and r >= committed_round)


def plan_round(members: dict[str, tuple[str, int]], round_id: int,
               hosts_version: int, holders: Iterable[str] = (),
               restore_from_storage: bool = False,
               restore_checkpoint: list[int] | None = None) -> dict[str, dict[str, Any]]:
    """Every member's place in a new round.

    Args:
        members: worker id -> (node id, age), age being start order.
        round_id: the round's number (its store keys are its own).
        hosts_version: the host-set version the round is formed at.
        holders: the workers that hold the job's state (they synced it in an earlier
            round); empty before the job's first commit.
        restore_from_storage: no worker holds the state: the round restores a durable
            checkpoint (every worker is told, a stale holder too).
        restore_checkpoint: which one, `[generation, commit]` (None: the latest).

    The oldest member that holds the state becomes rank 0, since every rank syncs from
    rank 0 (an older member that joined but never synced holds only its initial state);
    workers on one node get consecutive ranks, nodes ordered by their first worker.
    O(N log N) in the members (the sort by age).
    """
    holders = set(holders)
    by_age = sorted(members, key=lambda w: (bool(holders) and w not in holders,
                                            members[w][1]))
    slots = assign_ranks([members[w][0] for w in by_age])
    # a place is O(1) in the round's size: no list of every rank's host (10,000 copies of
    # a 10,000-entry list were GBs per round); what a worker needs of its host is its own
    return {worker_id: {"rank": slot.rank, "size": len(by_age), "local_rank": slot.local_rank,
                        "local_size": slot.local_size, "cross_rank": slot.cross_rank,
                        "cross_size": slot.cross_size, "round": round_id,
                        "hosts_version": hosts_version,
                        "restore_from_storage": restore_from_storage,
                        "restore_checkpoint": restore_checkpoint if restore_from_storage
                        else None, "elastic": True}
            for worker_id, slot in zip(by_age, slots)}

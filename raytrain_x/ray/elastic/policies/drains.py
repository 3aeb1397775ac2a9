"""Drains: which nodes started draining, what their workers and the round still forming
do about it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from raytrain_x.common.settings import short_node
from raytrain_x.ray.elastic.policies.views import MemberView, PendingView


@dataclass
class DrainNotice:
    """What a change in the draining nodes asks for."""

    new: dict[str, float] = field(default_factory=dict)  # node -> deadline (time.time())
    give_up: list[object] = field(default_factory=list)  # starting workers on them
    leaving: dict[str, int] = field(default_factory=dict)  # node -> members that leave

    @property
    def interrupt(self) -> bool:
        """Whether members must leave (every rank is interrupted at its next commit)."""
        return bool(self.leaving)


def notice_drains(draining: Mapping[str, float], known: Iterable[str],
                  pending: Iterable[PendingView], member_nodes: Iterable[str]) -> DrainNotice:
    """The nodes that started draining since `known`, the starting workers on them (given
    up) and how many members each has (they leave at the next commit, without a restore or
    a blacklist)."""
    known = set(known)
    notice = DrainNotice(new={n: d for n, d in sorted(draining.items()) if n not in known})
    members = list(member_nodes)
    for node in notice.new:
        notice.give_up += [p.key for p in pending if p.node == node]
        count = members.count(node)
        if count:
            notice.leaving[node] = count
    return notice


def asks_checkpoint(notice: DrainNotice, holders: Iterable[str] | None,
                    member_nodes: Mapping[str, str], draining: Iterable[str],
                    durable: bool) -> bool:
    """Whether a drain asks rank 0 for a durable checkpoint at its next commit: the job
    writes them (`durable`), and this drain (`notice`) leaves every holder of the committed
    state (`holders`, on their `member_nodes`) on a draining node. The holders stay until
    others have synced from them, but a whole pool that drains at once (a spot notice for
    one instance type or zone) may be gone before any replacement starts; then the job
    restores from storage, and the checkpoint written at the notice loses nothing since."""
    holders = list(holders or ())
    draining = set(draining)
    return (durable and bool(notice.new) and bool(holders)
            and bool(set(notice.new) & {member_nodes.get(h) for h in holders})
            and all(member_nodes.get(h) in draining for h in holders))


def abandons_forming_round(notice: DrainNotice, in_round: Iterable[str], round_id: int,
                           committed_round: int, synced: bool = False) -> bool:
    """Whether a drain gives up the round now forming: a member of that round (`in_round`:
    the nodes of its ranks) is on a newly draining node, and the round is still forming:
    it has not committed (`committed_round` < `round_id`) and not every member has said it
    synced the state in it (`synced`: its rendezvous and state sync are over, it runs its
    first steps). Such a member could only leave at the round's first commit, after the
    round formed in full, and then every rank would meet once more; the round's peers are
    answered at once instead and form the next round without it. A round that has synced
    is not given up: its members on the draining node leave at its first commit, as at any
    other, and nothing is restored."""
    return (round_id > committed_round and not synced
            and bool(set(notice.leaving) & set(in_round)))


def held_back(held: Iterable[str], members: Iterable[MemberView], draining: Iterable[str],
              min_workers: int, responsive: Iterable[str],
              holders: Iterable[str] | None) -> set[str]:
    """The newcomers of a given-up round (`held`) that the next round forms without: the
    others recover first, and they are restarted (the one that made the given-up round
    slow would make the next one as slow). None when the members in a round that stay
    and are known to be there (`responsive`: they answered the last heartbeat) are too
    few for a round on their own (the first round, fewer than `min_workers`, or peers
    gone unseen): then everyone waits for them as before. A newcomer that synced the
    job's state (one of `holders`) is never restarted: it arrived, and it may be the
    state's last copy when a veteran's node is gone unseen."""
    held, draining, responsive = set(held), set(draining), set(responsive)
    veterans = [m for m in members if m.in_round and not m.leaving and m.node not in draining
                and m.worker_id not in held and m.worker_id in responsive]
    if len(veterans) < max(1, min_workers):
        return set()
    return held - set(holders or ())


def drain_line(node: str, deadline: float, now: float, workers: int,
               why: str = "is draining") -> str:
    """The progress line of a node that started draining (or, `why`, left discovery or
    was blacklisted)."""
    left_s = deadline - now
    when = "no deadline" if math.isinf(left_s) else f"deadline in {left_s:.0f} s"
    return (f"node {short_node(node)} {why} ({when}); its {workers} worker(s) leave the "
            "job at the next commit")

"""Which arrays of a batch lie back to back on every rank: facts agreed in negotiation.

Across a network, arrays that follow each other in memory on every member cross as one
piece (`pieces.in_flight_pieces`), but whether they do is each rank's own fact, and every
member must cut a batch into the same pieces. So the first time a pair of names meets in a
world batch, each rank notes its own answer and the batch is cut as if they lay apart; the
next cycle's status word (`negotiation`) carries every rank's answers, and-ed, to all; from
then on the batches that hold both cut alike, agreed, with no collective of their own. A
layout that changes later costs a rank a copy (it packs that piece), never a wrong result.

Pairs of other process sets are never voted on (the world's status word is not theirs):
their arrays cross piece by piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Key = tuple[int, str, str]  # (process set, name, the next name)

# agreed pairs kept (a model's gradients: a few hundred); past it they are forgotten on
# every rank in the same cycle and asked again
AGREED_PAIRS = 1 << 16


class LayoutVotes:
    """The agreed layout facts of one engine, and this rank's answers waiting to be sent."""

    def __init__(self, capacity: int = AGREED_PAIRS) -> None:
        self._capacity = capacity
        self._agreed: dict[Key, bool] = {}
        self._asked: dict[Key, bool] = {}  # this rank's answers, in the order met

    def joined(self, set_id: int, names: Sequence[str],
               follows: Callable[[int], bool]) -> list[bool]:
        """For each array of a batch (`names`, in batch order), whether it crosses with the
        one before it: True only where every member agreed that it lies right after it.
        `follows(i)` is this rank's answer for arrays i and i + 1, asked once per pair."""
        out = [False]
        for i, (a, b) in enumerate(zip(names, names[1:])):
            key = (set_id, a, b)
            agreed = self._agreed.get(key)
            if agreed is None and set_id == 0 and key not in self._asked:
                self._asked[key] = follows(i)
            out.append(bool(agreed))
        return out

    def votes(self) -> list[bool]:
        """This rank's answers not sent yet, in the order met (the same pairs, in the same
        order, on every rank: batches run in the agreed order)."""
        return list(self._asked.values())

    def settle(self, agreed: Sequence[bool]) -> None:
        """Takes the and-ed answers to `votes()` from the status word."""
        if not self._asked:
            return
        if len(self._agreed) + len(self._asked) > self._capacity:
            self._agreed.clear()
        self._agreed.update(zip(self._asked, agreed))
        self._asked = {}

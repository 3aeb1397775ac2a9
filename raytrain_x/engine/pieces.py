"""A fused batch across a network, in pieces: how it is cut (`in_flight_pieces`) and the
stream that keeps a few pieces on the wire at once, across batches (`PieceStream`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

# Over a network, a fused batch with arrays of at least this many bytes crosses in pieces,
# the smaller arrays packed together first, each piece scaled (the small ones unpacked)
# while others cross, rather than the whole batch packed and unpacked while the link idles.
IN_FLIGHT_MIN_BYTES = 1 << 20
# Pieces handed to the group at once: gloo's two threads, one for each. More wait in its
# queue, which also holds the engine's next negotiation behind them: the torch face's
# gradients across a network gained a little with 4, the TensorFlow face's chunks lost
# more (each batch of chunks agreed later).
IN_FLIGHT_DEPTH = 2
# Arrays that lie back to back on every rank cross together, in pieces up to this size:
# fewer, larger transfers than one per array (each costs a round of messages), still cut
# finely enough for the transfers to overlap the scaling.
IN_FLIGHT_PIECE_BYTES = 4 << 20


class PieceStream:
    """Pieces of fused batches on a network group's wire, in order, `IN_FLIGHT_DEPTH` at
    once, across batches: the last pieces of one batch are still crossing while the
    engine agrees on the next one. Each piece's `after` (its scaling or unpacking) runs
    once it has landed and the piece behind it is on the wire; a batch's `done` runs after
    its last piece's `after`.

    Every rank sends the same pieces in the same order (they are cut from agreed sizes), so
    when this rank lands a piece says nothing the others must match."""

    def __init__(self) -> None:
        # [finish, after, done]: on the wire, oldest first
        self._waiting: deque[list[Any]] = deque()
        self._landed: list[Any] | None = None  # reduced; its `after` not run yet

    def __len__(self) -> int:
        return len(self._waiting) + (self._landed is not None)

    def send(self, group: Any, array: Any, op: str, after: Callable[[], None]) -> None:
        """Puts `array` on the wire, then finishes the piece that landed before it."""
        self._waiting.append([group.allreduce_async(array, op), after, None])
        self._finish_landed()

    def make_room(self) -> None:
        """Waits for the oldest piece when `IN_FLIGHT_DEPTH` are on the wire; its `after`
        runs at the next `send` (or `drain`)."""
        while len(self._waiting) >= IN_FLIGHT_DEPTH:
            self._land_oldest()

    def close_batch(self, done: Callable[[BaseException | None], None]) -> None:
        """`done(None)` once every piece sent so far has landed and been finished."""
        if self._waiting:
            self._waiting[-1][2] = done
        elif self._landed is not None and self._landed[2] is None:
            self._landed[2] = done
        else:
            done(None)

    def drain(self) -> None:
        """Lands and finishes every piece."""
        while self._waiting:
            self._land_oldest()
        self._finish_landed()

    def fail(self, error: BaseException) -> None:
        """Gives `error` to every batch still on the wire and forgets them."""
        entries = ([self._landed] if self._landed is not None else []) + list(self._waiting)
        self._landed = None
        self._waiting.clear()
        for entry in entries:
            if entry[2] is not None:
                entry[2](error)

    def _land_oldest(self) -> None:
        """Finishes the piece that landed before, then waits for the oldest on the wire."""
        self._finish_landed()
        self._waiting[0][0]()  # raises when the transfer failed: the entry stays for `fail`
        self._landed = self._waiting.popleft()

    def _finish_landed(self) -> None:
        entry, self._landed = self._landed, None
        if entry is None:
            return
        try:
            entry[1]()
        except BaseException as exc:
            if entry[2] is not None:
                entry[2](exc)
            raise
        if entry[2] is not None:
            entry[2](None)


def in_flight_pieces(sizes: list[int], joined: list[bool] | None = None) -> list[list[int]]:
    """A batch's arrays (their bytes, in batch order) as pieces for the wire, in batch order
    after one packed piece of the small ones. `joined[i]`: array i lies right after array
    i - 1 in memory on every rank (views of one buffer, as `DistributedOptimizer`'s
    gradients are). Runs of joined arrays are cut into pieces of up to
    `IN_FLIGHT_PIECE_BYTES` (a larger array alone), each reduced where it lies; a piece of
    under `IN_FLIGHT_MIN_BYTES` gives its arrays to the packed piece, which goes first."""
    joined = joined or [False] * len(sizes)
    small: list[int] = []
    pieces: list[list[int]] = []
    piece: list[int] = []
    nbytes = 0

    def close() -> None:
        if nbytes >= IN_FLIGHT_MIN_BYTES:
            pieces.append(piece)
        else:
            small.extend(piece)

    for i, size in enumerate(sizes):
        if piece and (not joined[i] or nbytes + size > IN_FLIGHT_PIECE_BYTES):
            close()
            piece, nbytes = [], 0
        piece.append(i)
        nbytes += size
    if piece:
        close()
    return ([small] if small else []) + pieces

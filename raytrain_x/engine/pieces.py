"""A fused batch across a network, in pieces: how it is cut (`in_flight_pieces`) and the
stream that keeps a few pieces on the wire at once, across batches (`PieceStream`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# Over a network, a fused batch with arrays of at least this many bytes crosses in pieces,
# the smaller arrays packed together first, each piece scaled (the small ones unpacked)
# while others cross, rather than the whole batch packed and unpacked while the link idles.
IN_FLIGHT_MIN_BYTES = 1 << 20
# Pieces crossing at once: gloo's two threads, one for each; the next piece goes out as
# soon as either lands, whichever it is. More wait in gloo's queue, which also holds the
# engine's next negotiation behind them: the torch face's gradients across a network gained
# a little with 4, the TensorFlow face's chunks lost more (each batch of chunks agreed later).
IN_FLIGHT_DEPTH = 2
# Pieces sent and not yet finished (landed, then scaled or unpacked in order): a large piece
# may still cross while smaller ones behind it land and more go out, up to this many.
IN_FLIGHT_HELD = 2 * IN_FLIGHT_DEPTH
# Arrays that lie back to back on every rank cross together, in pieces up to this size (DDP's
# bucket): fewer, larger transfers than one per array, each costing a round of messages and
# the engine's handling; gloo over loopback, where that CPU is taken from the transfers, took
# 6% less a step than with 4 MB pieces, and a 1 Gbit/s link the same.
IN_FLIGHT_PIECE_BYTES = 25 << 20


class _Piece:
    __slots__ = ("wait", "after", "done", "landed")

    def __init__(self, after: Callable[[], None]) -> None:
        # raises when the transfer failed; set as it is sent, before the stream holds it
        self.wait: Callable[[], None] | None = None
        self.after = after
        self.done: Callable[[BaseException | None], None] | None = None  # its batch's
        self.landed = False


class PieceStream:
    """Pieces of fused batches on a network group's wire, in order, `IN_FLIGHT_DEPTH`
    crossing at once, across batches: the last pieces of one batch are still crossing
    while the engine agrees on the next one. A piece goes out as soon as any crossing one
    lands. Pieces are finished in the order they were sent: each piece's `after` (its
    scaling or unpacking) runs once it and every piece before it have landed, at the next
    `send` (so that the next piece is already on the wire) or `drain`; a batch's `done`
    runs after its last piece's `after`.

    Every rank sends the same pieces in the same order (they are cut from agreed sizes), so
    when this rank's pieces land says nothing the others must match."""

    def __init__(self, wakes: threading.Condition | None = None) -> None:
        self._pieces: deque[_Piece] = deque()  # sent, not finished; oldest first
        self._cond = threading.Condition()  # a piece landed
        # notified (from the group's thread) whenever a piece lands: the condition an idle
        # engine waits on in `wait_for_work`
        self.wakes = wakes

    def __len__(self) -> int:
        return len(self._pieces)

    def send(self, group: Any, array: Any, op: str, after: Callable[[], None]) -> None:
        """Puts `array` on the wire, then finishes the pieces that landed before it."""
        piece = _Piece(after)
        piece.wait = group.allreduce_async(array, op, lambda: self._landed(piece))
        self._pieces.append(piece)
        self.finish_landed(before=piece)

    def make_room(self) -> None:
        """Waits until fewer than `IN_FLIGHT_DEPTH` pieces cross and fewer than
        `IN_FLIGHT_HELD` are unfinished (finishing the oldest for room)."""
        with self._cond:
            self._cond.wait_for(
                lambda: sum(not p.landed for p in self._pieces) < IN_FLIGHT_DEPTH)
        while len(self._pieces) >= IN_FLIGHT_HELD:
            self._land_oldest()

    def close_batch(self, done: Callable[[BaseException | None], None]) -> None:
        """`done(None)` once every piece sent so far has landed and been finished."""
        if self._pieces:
            self._pieces[-1].done = done
        else:
            done(None)

    def wait_for_work(self, has_work: Callable[[], bool], seconds: float) -> None:
        """Until `has_work()` (asked under `wakes`, which whoever brings work notifies) or
        `seconds` pass, finishing the pieces as they land (each landing notifies `wakes`
        too), so their batches complete while the engine has nothing else to do."""
        deadline = time.monotonic() + seconds
        while True:
            self.finish_landed()
            with self.wakes:
                left = deadline - time.monotonic()
                if has_work() or left <= 0:
                    return
                if not (self._pieces and self._pieces[0].landed):  # else: finish it first
                    self.wakes.wait(left)

    def drain(self) -> None:
        """Lands and finishes every piece."""
        while self._pieces:
            self._land_oldest()

    def fail(self, error: BaseException) -> None:
        """Gives `error` to every batch still on the wire and forgets them."""
        pieces = list(self._pieces)
        self._pieces.clear()
        for piece in pieces:
            if piece.done is not None:
                piece.done(error)

    def _landed(self, piece: _Piece) -> None:  # from the group's thread
        with self._cond:
            piece.landed = True
            self._cond.notify_all()
        if self.wakes is not None:
            with self.wakes:
                self.wakes.notify_all()

    def _land_oldest(self) -> None:
        oldest = self._pieces[0]
        with self._cond:
            self._cond.wait_for(lambda: oldest.landed)
        self.finish_landed()

    def finish_landed(self, before: _Piece | None = None) -> None:
        """Finishes the landed pieces at the head, oldest first (up to `before`); never
        waits for one still crossing."""
        while self._pieces and self._pieces[0].landed and self._pieces[0] is not before:
            piece = self._pieces[0]
            piece.wait()  # raises when the transfer failed: the piece stays for `fail`
            self._pieces.popleft()
            try:
                piece.after()
            except BaseException as exc:
                if piece.done is not None:
                    piece.done(exc)
                raise
            if piece.done is not None:
                piece.done(None)


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

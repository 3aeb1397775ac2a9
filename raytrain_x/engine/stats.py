"""The engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since the engine started: the autotuner scores samples with bytes and
    seconds per collective; the job's metrics export all of them (`core.status`)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cycles: int = 0
    active_cycles: int = 0  # cycles that ran at least one collective
    negotiations: int = 0  # cycles that needed the allgather of reports
    cache_hits: int = 0  # collectives agreed from the response cache's bits, no report
    speculated: int = 0  # cycles whose batch went with its readiness count (one round trip)
    speculation_misses: int = 0  # speculative cycles some rank was not ready for
    fused: int = 0  # allreduce batches of several tensors
    fused_tensors: int = 0  # ... and the tensors in them
    stalls: int = 0  # stall warnings (a tensor some rank did not submit for a while)
    # ... of which were reduced where they lie (no packing), or crossed a network in pieces
    fused_in_place: int = 0
    in_flight_pieces: int = 0  # pieces those batches crossed a network in

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

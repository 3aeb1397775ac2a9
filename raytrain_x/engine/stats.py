"""The engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters the autotuner scores samples with (bytes and seconds per collective)."""

    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cycles: int = 0
    active_cycles: int = 0  # cycles that ran at least one collective
    negotiations: int = 0  # cycles that needed the allgather of reports
    speculated: int = 0  # cycles whose batch went with its readiness count (one round trip)
    speculation_misses: int = 0  # speculative cycles some rank was not ready for
    fused: int = 0  # allreduce batches of several tensors
    fused_in_place: int = 0  # ... of which were reduced where they lie, with no packing

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

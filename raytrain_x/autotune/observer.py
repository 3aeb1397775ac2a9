"""Which knobs can matter in a job, from what it sends before autotune's search starts."""

from __future__ import annotations

import dataclasses

from raytrain_x.common.knobs import Knobs
from raytrain_x.engine.messages import ALLGATHER, ALLREDUCE, Response

# What the fusion threshold governs on this job's path, as frameworks report it.
BATCHING_FIXED_BUCKETS = "fixed buckets"  # buckets of a size the user fixed
BATCHING_RUNS = "threshold runs"  # units cut at the fusion threshold (DistributedOptimizer's)


@dataclasses.dataclass
class JobShape:
    """What the sampler knows of the world when it starts."""

    size: int = 1
    multi_level: bool = False  # more than one host and more than one worker per host
    # multi_level, and every host's workers share memory (the hierarchical allreduce's route)
    hierarchical_allreduce: bool = False


class JobObserver:
    """Which knobs can matter in this job, from what it sends before the search starts."""

    def __init__(self) -> None:
        self.allreduce_names: set[str] = set()
        self.fusable = False  # a cycle had two fusable requests
        self.allgathers = False
        self.batching: set[str] = set()  # what frameworks say the fusion threshold governs

    def observe(self, responses: list[Response]) -> None:
        fusable = 0
        for r in responses:
            if r.meta.kind == ALLREDUCE:
                if len(self.allreduce_names) <= 1 << 20:  # bounded: names may never repeat
                    self.allreduce_names.add(r.name)
                fusable += r.meta.fuse and not r.error
            elif r.meta.kind == ALLGATHER:
                self.allgathers = True
        # fusion can only matter where a cycle has two requests to fuse (a lone metric
        # allreduce now and then is not a batch)
        self.fusable = self.fusable or fusable >= 2

    def relevant(self, knobs: Knobs, shape: JobShape) -> tuple[list[str], dict[str, str]]:
        """(knobs to search, {knob: why it is left out})."""
        out: dict[str, str] = {}
        if not self.fusable and BATCHING_RUNS not in self.batching:
            out["fusion_threshold_bytes"] = (
                "every allreduce is a bucket of a size the user fixed (bucket_cap_mb)"
                if BATCHING_FIXED_BUCKETS in self.batching else "no fusable allreduce")
        names = len(self.allreduce_names)
        if 0 < names <= knobs.cache_capacity:
            out["cache_capacity"] = (f"all {names} allreduce names fit in {knobs.cache_capacity} "
                                     "entries")
        if not shape.multi_level:
            why = "needs several hosts with several workers each"
            out["hierarchical_allreduce"] = out["hierarchical_allgather"] = why
        else:
            if not shape.hierarchical_allreduce:
                out["hierarchical_allreduce"] = "some host's workers cannot share memory"
            if not self.allgathers:
                out["hierarchical_allgather"] = "no allgather"
        return [n for n in Knobs.specs() if n not in out], out

"""Horovod's `HOROVOD_*` environment variables, read as aliases of raytrain-x's own, so a
Horovod launch script keeps its settings. Ours win when both are set. docs/knobs.md lists
each pair."""

from __future__ import annotations

from collections.abc import Mapping

# ours -> Horovod's (same unit and meaning)
ALIASES = {
    "RAYTRAIN_X_FUSION_THRESHOLD": "HOROVOD_FUSION_THRESHOLD",
    "RAYTRAIN_X_CYCLE_TIME": "HOROVOD_CYCLE_TIME",
    "RAYTRAIN_X_CACHE_CAPACITY": "HOROVOD_CACHE_CAPACITY",
    "RAYTRAIN_X_HIERARCHICAL_ALLREDUCE": "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "RAYTRAIN_X_HIERARCHICAL_ALLGATHER": "HOROVOD_HIERARCHICAL_ALLGATHER",
    "RAYTRAIN_X_TIMELINE": "HOROVOD_TIMELINE",
    "RAYTRAIN_X_GPU_OPERATIONS": "HOROVOD_GPU_OPERATIONS",
    "RAYTRAIN_X_TIMELINE_MARK_CYCLES": "HOROVOD_TIMELINE_MARK_CYCLES",
    "RAYTRAIN_X_AUTOTUNE": "HOROVOD_AUTOTUNE",
    "RAYTRAIN_X_AUTOTUNE_LOG": "HOROVOD_AUTOTUNE_LOG",
    "RAYTRAIN_X_AUTOTUNE_WARMUP_SAMPLES": "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "RAYTRAIN_X_AUTOTUNE_STEPS_PER_SAMPLE": "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
    "RAYTRAIN_X_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "RAYTRAIN_X_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
    "RAYTRAIN_X_STALL_CHECK_TIME_SECONDS": "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "RAYTRAIN_X_STALL_SHUTDOWN_TIME_SECONDS": "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
}


def with_horovod_aliases(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus, for each of our variables that is unset or empty, its Horovod alias."""
    merged = dict(env)
    for ours, theirs in ALIASES.items():
        if not merged.get(ours) and merged.get(theirs):
            merged[ours] = merged[theirs]
    return merged

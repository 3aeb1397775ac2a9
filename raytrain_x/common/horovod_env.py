"""Horovod's `HOROVOD_*` environment variables, read as aliases of raytrain-x's own, so a
Horovod launch script keeps its settings. Ours win when both are set. Each pair is declared
with the setting (`raytrain_x.common.settings`, its `horovod`); docs/knobs.md lists them."""

from __future__ import annotations

from collections.abc import Mapping

from raytrain_x.common.settings import horovod_aliases

ALIASES = horovod_aliases()  # ours -> Horovod's (same unit and meaning)


def with_horovod_aliases(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus, for each of our variables that is unset or empty, its Horovod alias."""
    merged = dict(env)
    for ours, theirs in ALIASES.items():
        if not merged.get(ours) and merged.get(theirs):
            merged[ours] = merged[theirs]
    return merged


def worker_env(rank: int, size: int, local_rank: int, local_size: int, cross_rank: int,
               cross_size: int, hostname: str) -> dict[str, str]:
    """The variables horovodrun sets in each worker (`HOROVOD_RANK`, `HOROVOD_SIZE`, ...,
    `HOROVOD_HOSTNAME`), for scripts that read them; raytrain-x sets them in every worker
    and again at each elastic reset. `hostname` is the worker's Ray node address."""
    values = {"RANK": rank, "SIZE": size, "LOCAL_RANK": local_rank, "LOCAL_SIZE": local_size,
              "CROSS_RANK": cross_rank, "CROSS_SIZE": cross_size, "HOSTNAME": hostname}
    return {f"HOROVOD_{k}": str(v) for k, v in values.items()}

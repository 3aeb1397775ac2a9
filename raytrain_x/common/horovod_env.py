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

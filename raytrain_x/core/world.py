"""`init()` and `transport()`: the runtime (`runtime.py`) and the process sets
(`process_sets.py`) together. Process sets need the running engine and `init` registers
them, so this module sits above both and neither imports the other's caller."""

from __future__ import annotations

from collections.abc import Sequence

from raytrain_x.comm.rendezvous import Rendezvous
from raytrain_x.common.autotune_config import AutotuneConfig
from raytrain_x.common.errors import ConfigError
from raytrain_x.common.knobs import Knobs
from raytrain_x.core import runtime, status
from raytrain_x.core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    registered_id,
)


def init(
    process_sets: Sequence[ProcessSet] | str | None = None,
    knobs: Knobs | None = None,
    rendezvous: Rendezvous | None = None,
    autotune: AutotuneConfig | None | bool = None,
) -> None:
    """Joins the world and starts the engine; when already initialised, only registers the
    process sets of `process_sets` that are not registered yet.

    Args:
        process_sets: process sets to register on every rank; "dynamic" (Horovod's flag)
            is accepted: sets can always be added and removed after init.
        knobs: communication knobs (all held fixed); by default read from `RAYTRAIN_X_*`
            env and `RAYTRAIN_X_CONFIG_FILE`.
        rendezvous: where to meet; by default from the Ray executor or the environment.
        autotune: tune the free knobs while training (default: `RAYTRAIN_X_AUTOTUNE*` env;
            False: never).

    Every rank adopts rank 0's knobs, so a worker that joins a running elastic job uses
    the knobs the job has (tuned ones included).
    """
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ConfigError(f"init(process_sets={process_sets!r}): give a list of process "
                              "sets or 'dynamic'")
        process_sets = None  # sets can always be added and removed after init
    if runtime.start(knobs, rendezvous, autotune):
        status.start_status_file()
        global_process_set.ranks = list(range(runtime.size()))
    # Registered here whether or not this call started the runtime: an `init` whose sets
    # were refused (a rank out of range, a duplicate) can be called again with sets that
    # are right, as in Horovod; sets registered already are left as they are.
    # All of them or none: a refused list leaves nothing registered (Horovod's ValueError).
    new = [ps for ps in process_sets or ()
           if not (isinstance(ps, ProcessSet) and ps.process_set_id is not None)]
    rank_lists = [ps.ranks if isinstance(ps, ProcessSet) else ps for ps in new]
    if any(ranks is None for ranks in rank_lists):
        raise ConfigError("init(process_sets=...): the global process set is always "
                          "registered; list only sets of some ranks")
    runtime.engine().groups.check_new_sets(rank_lists)
    for ps in new:
        add_process_set(ps)


def transport(process_set: ProcessSet | None = None) -> str:
    """How collectives travel, for the global set or `process_set`: 'shm' (shared memory:
    every member on one host), 'gloo+shm' (the global set over several hosts, with shared
    memory for hierarchical local stages), 'gloo', or 'none' (this rank is not a member).
    Set `RAYTRAIN_X_SHM=0` to force gloo.

    Args:
        process_set: a registered process set; None for the global set.
    """
    if process_set is None:
        return runtime.engine().transport
    return runtime.engine().transport_of(registered_id(process_set))


def reset() -> None:
    """Leaves this world and joins the next rendezvous round (elastic). The knobs in effect
    carry over; tuning does not restart."""
    knobs = runtime.last_knobs()
    runtime.shutdown()
    init(knobs=knobs, autotune=False)

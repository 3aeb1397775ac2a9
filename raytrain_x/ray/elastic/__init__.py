"""The elastic job, driver side: a thin loop whose collaborators carry decisions out, pure
policies that make them, a worker pool and a cluster view that talk to Ray, and one event
log.

    job.py             ElasticJob: the loop (poll, then each collaborator acts); run_job:
                       a new job when the control actors died (with a checkpoint)
    context.py         JobContext: what the collaborators share
    member_watch.py    members' outcomes, failures, heartbeats, stragglers, state holders
    worker_starts.py   starting workers, the autoscaler's request, give-ups, min_workers
    drain_watch.py     draining nodes: give-ups, leaving members, a forming round given up
    round_forming.py   the next round: who leaves, departs, stays, with which rank
    policies/          the decisions (no Ray): scaling, drains, liveness, rounds
    rounds.py          the ElasticRounds actor workers join rounds at; plan_round
    events.py          the event log and the round history (no Ray)
    settings.py        ElasticSettings and the polling intervals (no Ray)
    pool.py            worker actors: start, poll, give up, kill, probe
    cluster.py         nodes, free slots, drains, node types, the autoscaler request
    parts.py           JobParts: what the job acts through (Ray's, or a simulation's)
"""

from __future__ import annotations

from raytrain_x.common.exports import lazy_names

# Each public name is loaded when first asked for: the rounds actor's process imports
# `rounds.py` alone, not the driver's job.
_HOMES: dict[str, str | None] = {
    "ElasticJob": "raytrain_x.ray.elastic.job",
    "run_job": "raytrain_x.ray.elastic.job",
    "HostDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "RayHostDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "TestDiscovery": "raytrain_x.ray.elastic.ray_nodes",
    "ElasticSettings": "raytrain_x.ray.elastic.settings",
    # Horovod's `horovod.ray.elastic` path; the executor is built on this package, so the
    # dependency runs from it to here and the alias makes none back
    "ElasticRayExecutor": "raytrain_x.ray.elastic_executor",
}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_names(__name__, _HOMES)

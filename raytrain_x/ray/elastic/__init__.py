"""The elastic job: a controller that carries out decisions, pure policies that make them,
a worker pool and a cluster view that talk to Ray, and one event log.

    controller.py   ElasticJob: the loop (poll, decide, act)
    policies.py     scaling, failures, drains, min_workers, stragglers, rounds (no Ray)
    events.py       the event log and the round history (no Ray)
    settings.py     ElasticSettings and the controller's intervals (no Ray)
    pool.py         worker actors: start, poll, give up, kill, probe
    cluster.py      nodes, free slots, drains, node types, the autoscaler request
"""

from raytrain_x.ray.elastic.controller import ElasticJob
from raytrain_x.ray.elastic.settings import ElasticSettings

__all__ = ["ElasticJob", "ElasticSettings"]

"""The elastic job's decisions, as pure policies (no Ray: an import-linter contract says
so). Each takes a snapshot of what the job saw and, where time matters, the clock's
reading, and returns what to do; the job's collaborators carry it out.
`tests/unit/test_elastic_policies.py` checks every decision with a fake clock.
"""

from __future__ import annotations

from raytrain_x.ray.elastic.policies.drains import (
    DrainNotice,
    abandons_forming_round,
    asks_checkpoint,
    drain_line,
    held_back,
    notice_drains,
)
from raytrain_x.ray.elastic.policies.injected import (
    DriverPolicy,
    JobSnapshot,
    Leave,
    WorkerSample,
)
from raytrain_x.ray.elastic.policies.liveness import (
    FailurePolicy,
    FailureVerdict,
    Heartbeats,
    StragglerRule,
    Stragglers,
    held_joins,
    spare_last_holders,
)
from raytrain_x.ray.elastic.policies.phases import (
    CHANGES,
    TRANSITIONS,
    AskedToLeave,
    Change,
    Event,
    JobEnded,
    NewcomersWaiting,
    NodesDraining,
    PeersWaiting,
    Phase,
    RoundFormed,
    WorkerFailed,
    WorkerFinished,
    next_phase,
)
from raytrain_x.ray.elastic.policies.rounds import (
    RoundDecision,
    batch_awaited,
    decide_round,
    holds_newcomers,
    kept_on_drain,
    state_lost,
    state_lost_error,
)
from raytrain_x.ray.elastic.policies.scaling import (
    MinimumWatch,
    ScalingPolicy,
    elastic_timeout_error,
    last_resort_nodes,
    shape,
)
from raytrain_x.ray.elastic.policies.slow_workers import SlowWorkers
from raytrain_x.ray.elastic.policies.views import (
    MemberView,
    PendingView,
)

__all__ = [
    'AskedToLeave', 'CHANGES', 'Change', 'Event', 'DrainNotice', 'DriverPolicy', 'FailurePolicy',
    'FailureVerdict', 'Heartbeats', 'JobEnded', 'JobSnapshot', 'Leave', 'MemberView',
    'MinimumWatch', 'NewcomersWaiting', 'NodesDraining', 'PeersWaiting', 'PendingView', 'Phase',
    'RoundDecision', 'RoundFormed', 'ScalingPolicy', 'SlowWorkers', 'StragglerRule',
    'Stragglers', 'TRANSITIONS', 'WorkerFailed', 'WorkerFinished', 'WorkerSample',
    'abandons_forming_round', 'asks_checkpoint', 'batch_awaited', 'decide_round', 'drain_line',
    'elastic_timeout_error', 'held_back', 'held_joins', 'holds_newcomers', 'kept_on_drain',
    'next_phase', 'notice_drains', 'shape', 'spare_last_holders', 'state_lost',
    'state_lost_error',
]

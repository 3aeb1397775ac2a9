"""The elastic job's phase: every transition of its table, in the order a job meets them,
and a change the table has no row for stopping the driver as the bug it is."""

from __future__ import annotations

import pytest

from raytrain_x.common.errors import InternalError
from raytrain_x.ray.elastic.policies import (
    CHANGES,
    TRANSITIONS,
    AskedToLeave,
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

S, T, R, F, E = Phase.STARTING, Phase.TRAINING, Phase.REFORMING, Phase.FINISHING, Phase.ENDED
FAILED = WorkerFailed("w1", "n1", 1, "process lost")
EXAMPLES = {WorkerFailed: FAILED, NodesDraining: NodesDraining(("n2",)),
            NewcomersWaiting: NewcomersWaiting(1), AskedToLeave: AskedToLeave("w2", "p", "slow"),
            PeersWaiting: PeersWaiting(2), RoundFormed: RoundFormed(2, 3, (FAILED,)),
            WorkerFinished: WorkerFinished("w0"), JobEnded: JobEnded()}

# every row of the table, written out: (phase, event kind) -> next phase
EXPECTED = {
    **{(S, kind): S for kind in CHANGES},  # a start's failures and newcomers: still starting
    (S, RoundFormed): T,
    **{(T, kind): R for kind in CHANGES},  # anything a round must answer
    (T, RoundFormed): T,  # a round for newcomers the last one left out
    (T, WorkerFinished): F,
    **{(R, kind): R for kind in CHANGES},  # more changes while it re-forms
    (R, RoundFormed): T,
    (R, WorkerFinished): F,  # a member finished before it saw the change
    **{(F, kind): F for kind in CHANGES},  # collected, not answered
    (F, WorkerFinished): F,
    (S, JobEnded): E, (T, JobEnded): E, (R, JobEnded): E, (F, JobEnded): E,
}


@pytest.mark.parametrize("row", sorted(EXPECTED, key=lambda r: (r[0].value, r[1].__name__)),
                         ids=lambda r: f"{r[0].value}-{r[1].__name__}")
def test_every_transition(row):
    phase, kind = row
    assert next_phase(phase, EXAMPLES[kind]) is EXPECTED[row]


def test_the_table_is_exactly_these_rows():
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize("phase, event", [
    (S, WorkerFinished("w0")),  # nobody trains before a round forms
    (F, RoundFormed(3, 2)),  # the job collects its results: no round forms
    (E, FAILED), (E, JobEnded()),  # an ended job meets nothing
])
def test_an_event_without_a_row_is_a_driver_bug(phase, event):
    with pytest.raises(InternalError, match=f"met {type(event).__name__} in phase "
                                           f"{phase.value}"):
        next_phase(phase, event)


def test_a_failure_travels_as_one_value_into_the_round_that_answers_it():
    phase, answers = S, []
    for event in (RoundFormed(1, 3), FAILED, PeersWaiting(2)):
        phase = next_phase(phase, event)
        if not isinstance(event, RoundFormed):
            answers.append(event)
    assert phase is R
    formed = RoundFormed(2, 2, tuple(answers))
    assert next_phase(phase, formed) is T and formed.answers[0] is FAILED

"""Layout facts agreed in negotiation (`engine.plan.LayoutVotes`): a pair of names is asked once,
cut apart until the next status word brings every rank's answer, and-ed; then it crosses
together wherever every rank said so. Other process sets' pairs are never asked."""

from __future__ import annotations

from raytrain_x.engine.negotiation import _bit_words, _flags
from raytrain_x.engine.plan import LayoutVotes


def _answers(*values: bool):
    asked = []

    def follows(i: int) -> bool:
        asked.append(i)
        return values[i]
    return follows, asked


def test_a_pair_is_cut_apart_until_its_answers_come_back_and_together_after():
    layout = LayoutVotes()
    follows, asked = _answers(True, True, False)
    assert layout.joined(0, ["a", "b", "c", "d"], follows) == [False] * 4
    assert asked == [0, 1, 2]
    # the same batch again before the status word: nothing asked twice
    assert layout.joined(0, ["a", "b", "c", "d"], follows) == [False] * 4
    assert asked == [0, 1, 2]
    assert layout.votes() == [True, True, False]
    layout.settle([True, False, False])  # on another rank "c" does not follow "b"
    assert layout.votes() == []
    assert layout.joined(0, ["a", "b", "c", "d"], follows) == [False, True, False, False]
    assert asked == [0, 1, 2]  # agreed pairs are not asked again


def test_a_new_pair_in_a_known_batch_is_asked_alone():
    layout = LayoutVotes()
    layout.joined(0, ["a", "b"], lambda i: True)
    layout.settle(layout.votes())
    follows, asked = _answers(True, True)
    assert layout.joined(0, ["a", "b", "c"], follows) == [False, True, False]
    assert asked == [1] and layout.votes() == [True]


def test_other_process_sets_are_never_asked():
    layout = LayoutVotes()
    follows, asked = _answers(True)
    assert layout.joined(3, ["a", "b"], follows) == [False, False]
    assert asked == [] and layout.votes() == []


def test_past_the_capacity_every_rank_forgets_in_the_same_cycle():
    layout = LayoutVotes(capacity=3)
    layout.joined(0, ["a", "b", "c"], lambda i: True)
    layout.settle(layout.votes())
    assert layout.joined(0, ["a", "b", "c"], lambda i: True) == [False, True, True]
    layout.joined(0, ["x", "y", "z"], lambda i: True)
    layout.settle(layout.votes())  # 2 + 2 > 3: the old ones go, the new ones stay
    assert layout.joined(0, ["x", "y", "z"], lambda i: True) == [False, True, True]
    assert layout.joined(0, ["a", "b"], lambda i: True) == [False, False]


def test_flags_travel_as_bits_of_words_and_come_back():
    for n in (0, 1, 63, 64, 65, 200):
        flags = [i % 3 == 0 or i % 7 == 1 for i in range(n)]
        words = _bit_words(flags)
        assert len(words) == (n + 63) // 64
        assert _flags(words, n) == flags

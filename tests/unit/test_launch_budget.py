"""The fake provider's launch budget, which tests use to make nodes arrive in an order."""

from __future__ import annotations

import threading

from raytrain_x.testing.provider import take_launch, write_launch_budget


def test_no_budget_file_means_no_limit(tmp_path):
    budget = str(tmp_path / "budget")
    assert all(take_launch(budget) for _ in range(5))


def test_each_launch_takes_one_and_none_is_left_after(tmp_path):
    budget = str(tmp_path / "budget")
    write_launch_budget(budget, 2)
    assert [take_launch(budget) for _ in range(4)] == [True, True, False, False]
    write_launch_budget(budget, 1)  # the test allows one more
    assert take_launch(budget) and not take_launch(budget)
    write_launch_budget(budget, None)  # and then any number
    assert take_launch(budget) and take_launch(budget)


def test_launchers_on_several_threads_take_no_more_than_the_budget(tmp_path):
    budget = str(tmp_path / "budget")
    write_launch_budget(budget, 3)
    taken = []
    threads = [threading.Thread(target=lambda: taken.append(take_launch(budget)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == [False] * 5 + [True] * 3

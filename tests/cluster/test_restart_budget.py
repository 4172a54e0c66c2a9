"""The launcher's restart budget (``cluster.launcher.RestartBudget``): how long a failed group
waits, and when it is given up."""

from __future__ import annotations

from pdserve.cluster.launcher import RestartBudget


def test_the_back_off_doubles_with_each_failure_in_a_row_up_to_its_cap() -> None:
    budget = RestartBudget(max_restarts=10, backoff=1.0)
    assert [budget.failed(5.0) for _ in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_part_is_given_up_after_max_restarts_in_a_row() -> None:
    budget = RestartBudget(max_restarts=3, backoff=1.0)
    assert [budget.failed(None) for _ in range(4)] == [1.0, 2.0, 4.0, None]  # never got ready, then down
    assert RestartBudget(max_restarts=0, backoff=1.0).failed(3600.0) is None  # no restarts at all


def test_a_part_that_served_a_minute_starts_its_count_afresh() -> None:
    """Failures days apart never add up to the limit; quick ones after a long stable run still do."""
    budget = RestartBudget(max_restarts=2, backoff=1.0)
    for _ in range(50):  # one failure a day: always the first in a row
        assert budget.failed(86_400.0) == 1.0
    assert budget.failed(2.0) == 2.0  # failed again at once after its restart
    assert budget.failed(2.0) is None  # the third in a row: down


def test_a_group_that_fails_for_ever_waits_the_cap_and_never_overflows() -> None:
    """With a large ``--max-restarts``, the 1025th failure in a row doubled the back-off past
    a float (OverflowError), which took the launcher down with its ranks left running."""
    budget = RestartBudget(max_restarts=10**6, backoff=1.0)
    assert {budget.failed(None) for _ in range(2000)} >= {30.0}
    assert budget.failed(None) == 30.0

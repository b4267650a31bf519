"""The router's record of a replica's pull credit (scheduling/credit.py): a seat
spent for an Assign that is never sent (a held arrival refused, cancelled or
timed out) comes back exactly, so the replica is neither starved nor over-bound."""

import pytest

from router.scheduling.credit import Credit


@pytest.mark.parametrize("granted,context,taken", [(1000, 300, 300), (100, 300, 100)])
def test_a_refund_gives_back_what_the_spend_took(granted, context, taken):
    """Within the tokens granted, and past them: the last assignment may overrun
    the grant, but the overrun is not owed, so giving it back must not leave more
    credit than the replica granted."""
    credit = Credit(seat_limit=8)
    credit.grant(2, granted)
    assert credit.spend(context) == taken
    assert (credit.requests, credit.tokens) == (1, granted - taken)
    credit.refund(taken)
    assert (credit.requests, credit.tokens) == (2, granted)


def test_a_grant_between_spend_and_refund_is_kept():
    credit = Credit()
    credit.grant(1, 500)
    taken = credit.spend(200)
    credit.grant(1, 400)   # a Pull adds to what is outstanding
    credit.refund(taken)
    assert (credit.requests, credit.tokens) == (2, 900)


def test_without_a_token_limit_only_the_seat_comes_back():
    credit = Credit()
    credit.grant(3, None)
    taken = credit.spend(5000)
    assert taken == 0 and credit.token_limit is None
    credit.refund(taken)
    assert (credit.requests, credit.token_limit) == (3, None)

"""The router's record of a replica's pull credit (scheduling/credit.py): a seat
spent for an Assign that is never sent (a held arrival refused, cancelled or
timed out) comes back exactly, so the replica is neither starved nor over-bound."""

from router.scheduling.credit import Credit


def test_a_refund_gives_back_what_the_spend_took():
    credit = Credit(seat_limit=8)
    credit.grant(2, 1000)
    taken = credit.spend(300)
    assert (credit.requests, credit.tokens, taken) == (1, 700, 300)
    credit.refund(taken)
    assert (credit.requests, credit.tokens) == (2, 1000)


def test_an_overrun_is_refunded_only_as_far_as_it_was_covered():
    # The last assignment may overrun the tokens granted; the overrun is not
    # owed, so giving it back must not leave more credit than the replica granted.
    credit = Credit()
    credit.grant(2, 100)
    taken = credit.spend(300)
    assert (credit.tokens, taken) == (0, 100)
    credit.refund(taken)
    assert (credit.requests, credit.tokens) == (2, 100)


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

"""Pull credit: grants never exceed the engine's capacity, and never stall it."""

from replica_worker.engine.schedulers.base import AdmissionCapacity
from replica_worker.worker.credit import PullCredit


def test_token_credit_is_topped_up_when_request_credit_is_still_outstanding():
    # A grant made under a prefill backlog carries many seats but few tokens.
    credit = PullCredit()
    assert credit.grant(AdmissionCapacity(127, 12)) == (127, 12)
    # The backlog cleared: the router still holds 127 seats of credit but only
    # 12 tokens, so no queued prompt fits. Without more tokens the replica
    # would sit idle with free seats and cache until it drained completely.
    assert credit.grant(AdmissionCapacity(126, 5000)) == (0, 4988)
    assert (credit.outstanding_requests, credit.outstanding_tokens) == (127, 5000)


def test_grant_never_exceeds_capacity():
    credit = PullCredit()
    assert credit.grant(AdmissionCapacity(4, 1000)) == (4, 1000)
    assert credit.grant(AdmissionCapacity(4, 1000)) is None
    credit.on_assigned(1, 300)
    # One request (300 tokens) is queued, not yet in the engine's capacity.
    assert credit.grant(AdmissionCapacity(4, 1000), queued_requests=1, queued_tokens=300) is None
    assert credit.grant(AdmissionCapacity(3, 1500)) == (0, 800)


def test_no_capacity_no_grant():
    credit = PullCredit()
    assert credit.grant(AdmissionCapacity(0, 0)) is None
    assert credit.grant(AdmissionCapacity(3, 0)) is None


def test_a_freed_seat_is_granted_while_token_credit_is_still_open():
    credit = PullCredit()
    assert credit.grant(AdmissionCapacity(2, 1024)) == (2, 1024)
    credit.on_assigned(2, 200)  # two short prompts: 824 tokens of credit still open
    # A seat frees while a prefill backlog keeps the engine's token room (600)
    # under the open credit: the seat alone is granted (0 tokens added), else
    # the router could not use the open tokens and the replica would idle.
    assert credit.grant(AdmissionCapacity(1, 600)) == (1, 0)
    assert (credit.outstanding_requests, credit.outstanding_tokens) == (1, 824)

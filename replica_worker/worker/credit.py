"""Pull credit: how much work the replica has granted the router and not yet received.

Pull messages add credit (see replica.proto). The replica grants only the
engine's admission capacity beyond what is still outstanding, so a grant
and an assignment crossing on the wire over-commit the engine by at most the
one prompt a grant's last assignment may overrun.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica_worker.engine.schedulers.base import AdmissionCapacity


@dataclass
class PullCredit:
    prefetch: int = 0  # extra requests the engine may hold waiting, to start the next step at once
    outstanding_requests: int = 0
    outstanding_tokens: int = 0

    def on_assigned(self, num_requests: int, num_tokens: int) -> None:
        self.outstanding_requests = max(0, self.outstanding_requests - num_requests)
        self.outstanding_tokens = max(0, self.outstanding_tokens - num_tokens)

    def reset(self) -> None:
        """A new router session starts with no outstanding credit."""
        self.outstanding_requests = self.outstanding_tokens = 0

    def grant(
        self, capacity: AdmissionCapacity, queued_requests: int = 0, queued_tokens: int = 0
    ) -> tuple[int, int] | None:
        """The (requests, tokens) to grant now, or None when nothing is worth asking for.

        queued_*: assignments received but not yet inside the engine (the
        capacity does not reflect them yet).
        """
        if capacity.max_prompt_tokens <= 0:
            return None
        want_requests = capacity.max_requests + (self.prefetch if capacity.max_requests else 0)
        requests = want_requests - queued_requests - self.outstanding_requests
        tokens = capacity.max_prompt_tokens - queued_tokens - self.outstanding_tokens
        # Each dimension is topped up on its own: a grant made under a prefill
        # backlog leaves many seats but few tokens outstanding, and one made
        # while the token credit is still open (nothing arrived to use it)
        # leaves tokens but no seats; waiting for the other dimension to be
        # used first would idle the replica.
        requests, tokens = max(requests, 0), max(tokens, 0)
        if not requests and not tokens:
            return None
        self.outstanding_requests += requests
        self.outstanding_tokens += tokens
        return requests, tokens

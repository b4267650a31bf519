"""Pull credit: what a replica has granted the router and not yet received.

A Pull adds to what is outstanding (replica.proto). The router assigns at most
the outstanding requests, and assigns while prompt-token credit is left; each
assignment uses up its share, and the last may overrun the tokens by one
prompt. The replica's declared capacity caps the seats: no replica is ever
bound more requests than its seats plus the prefetch it declared.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Credit:
    seat_limit: int = 0          # max_num_seqs + prefetch as declared; 0: not declared
    requests: int = 0
    tokens: int = 0
    unlimited_tokens: bool = True
    pulled_at: float = 0.0

    def grant(self, max_requests: int, max_prompt_tokens: int | None) -> None:
        """max_prompt_tokens None: no token limit (the field absent on the wire)."""
        self.requests += max_requests
        if max_prompt_tokens is None:
            self.unlimited_tokens = True
        else:
            self.tokens = (0 if self.unlimited_tokens else self.tokens) + max_prompt_tokens
            self.unlimited_tokens = False
        self.pulled_at = time.monotonic()

    def seats(self, owned: int) -> int:
        """Requests that may be assigned now, given how many the replica already runs."""
        if self.seat_limit:
            return max(0, min(self.requests, self.seat_limit - owned))
        return self.requests

    def wants_work(self, owned: int) -> bool:
        return self.seats(owned) > 0 and (self.unlimited_tokens or self.tokens > 0)

    @property
    def token_limit(self) -> int | None:
        return None if self.unlimited_tokens else self.tokens

    def spend(self, context_tokens: int) -> int:
        """Uses one request's share; returns the prompt tokens it took, which
        refund gives back."""
        self.requests -= 1
        # An overrun (see lua.POP) is not carried into the next grant: the
        # replica's capacity already counts the request it started.
        taken = 0 if self.unlimited_tokens else min(self.tokens, context_tokens)
        self.tokens = max(0, self.tokens - context_tokens)
        return taken

    def refund(self, tokens: int) -> None:
        """Gives back what spend took for a request whose Assign was never sent.
        Grants add to what is outstanding, so a grant in between is kept."""
        self.requests += 1
        if not self.unlimited_tokens:
            self.tokens += tokens

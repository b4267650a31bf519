"""How fast a replica prefills, in tokens a second, as its own steps show it.

Pull affinity weighs a cached token against a second of waiting with this
rate (router/scheduling/policies/pull.py): a cached token saves the replica
1/rate seconds of compute. Only steps that are mostly prefill count (at least
MIN_TOKENS tokens and TOKENS_PER_SEQ per sequence in the batch): a step of
decodes costs mostly its fixed overhead and would understate the rate many
times over. A mixed step's decodes still count towards its time, so the
estimate errs low, by about the decodes' share of the step.
"""

from __future__ import annotations

MIN_TOKENS = 64
TOKENS_PER_SEQ = 4
SMOOTHING = 0.2   # weight of the newest step in the moving average


class PrefillRate:
    def __init__(self) -> None:
        self.tokens_per_s: float | None = None   # None: no prefill-heavy step seen yet

    def observe(self, num_tokens: int, batch_size: int, step_time_s: float) -> bool:
        """One step's report; True when it counted."""
        if step_time_s <= 0 or num_tokens < max(MIN_TOKENS, TOKENS_PER_SEQ * batch_size):
            return False
        rate = num_tokens / step_time_s
        old = self.tokens_per_s
        self.tokens_per_s = rate if old is None else old + SMOOTHING * (rate - old)
        return True

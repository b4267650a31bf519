"""vLLM (v0) baseline: prefill-prioritising, no chunking.

When waiting sequences can be admitted, a step holds only their whole
prompts (up to max_num_batched_tokens); decodes wait. Otherwise the step
decodes every running sequence, preempting by recompute from the tail.
Prefill-decode interference and generation stalls are what Sarathi fixes.
"""

from __future__ import annotations

from replica_worker.engine.schedulers.base import BaseScheduler, _Step


class VllmScheduler(BaseScheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A whole context is computed in one step, so it must fit the budget.
        self.prompt_limit = min(self.max_model_len, self.budget)

    def _schedule(self, step: _Step) -> None:
        # Running sequences finish their prefill in the step that admits them;
        # anything still in prefill would be a stall, so it goes first.
        self._schedule_prefills(step, self._running_prefills(), chunked=False)
        self._admit_waiting(step, chunked=False)
        if step.prefills:
            return
        self._schedule_decodes(step)

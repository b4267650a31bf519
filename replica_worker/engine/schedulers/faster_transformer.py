"""FasterTransformer baseline: request-level batching.

A batch is admitted only when nothing is running, and runs (decoding every
step) until all of it has finished; arrivals meanwhile wait. Blocks for each
sequence's maximum length are reserved at admission, as in Orca.
"""

from __future__ import annotations

from replica_worker.engine.schedulers.base import _Step
from replica_worker.engine.schedulers.orca import OrcaScheduler


class FasterTransformerScheduler(OrcaScheduler):
    def _schedule(self, step: _Step) -> None:
        if self.running:
            prefilling = self._schedule_decodes(step)
            self._schedule_prefills(step, prefilling, chunked=False)
            return
        self._admit_waiting(step, chunked=False)

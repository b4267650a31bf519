"""Simple chunking baseline: chunked prefills, but never mixed with decodes.

Steps alternate between a prefill turn (chunks of running prefills, or else
of newly admitted sequences, under chunk_size) and a decode turn (every
running decode, preempting from the tail on block shortage). A turn with
nothing to do yields to the other one, so no step is idle while work exists.
"""

from __future__ import annotations

from replica_worker.engine.schedulers.base import BaseScheduler, _Step


class SimpleChunkingScheduler(BaseScheduler):
    CHUNKS_PREFILLS = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._prefill_turn = True

    def _step_budget(self) -> int:
        return self.config.chunk_size

    def _schedule(self, step: _Step) -> None:
        turns = [self._prefill_phase, self._decode_phase]
        if not self._prefill_turn:
            turns.reverse()
        for phase in turns:
            if phase(step):
                # The other kind of work goes next.
                self._prefill_turn = phase == self._decode_phase
                return

    def _prefill_phase(self, step: _Step) -> bool:
        # Admitted prefills finish before new ones start (Sarathi-Serve's order).
        self._schedule_prefills(step, self._running_prefills(), chunked=True)
        if not step.prefills:
            self._admit_waiting(step, chunked=True)
        return bool(step.prefills)

    def _decode_phase(self, step: _Step) -> bool:
        self._schedule_decodes(step)
        return bool(step.decodes)

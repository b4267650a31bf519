"""A model runner that runs no model: it waits as long as the cost model says the
batch would take, and samples tokens by a fixed rule.

Output token i of a request (resumed tokens counted) is (sum(prompt) + i) % vocab,
the rule of tests/support/scripted_replica.py, so a client can check every token.
The wait is time.sleep, which holds no GIL: many simulated replicas share a
host's cores, each costing only its scheduler's work. With a SharedDevice the
wait is shared: while n replicas sharing it are in a step, each advances at 1/n.

With `overlap` the runner models async scheduling, the CUDA default
(replica_worker/engine/core.py): the host work before a step (resolving the
previous one, the worker's sending, scheduling) runs while the previous step is
on the device, so a step that follows another at once may start when that one
ended. The wall time since the previous step ended, up to that step's length,
counts as this step's device time already spent (on a shared device, at the
share of the moment). The step period is then about max(device, host), not
their sum. What async scheduling also does, hand a step's tokens out one step
later, is not modelled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from replica_worker.engine.sampler import SamplerOutput
from replica_worker.sim.cost_model import CostModel, StepFeatures, features_of
from replica_worker.sim.shared_device import SharedDevice


def rule_token(prompt_token_ids, index: int, vocab_size: int) -> int:
    return (sum(prompt_token_ids) + index) % vocab_size


def chunk_signature(chunks) -> tuple[tuple[str, int, int], ...]:
    """(request id, tokens computed, tokens computed before) per chunk, in order:
    what two engines must agree on for their schedules to be the same."""
    return tuple((c.seq.seq_id, c.num_tokens, c.seq.num_computed_tokens) for c in chunks)


@dataclass(frozen=True)
class ScheduledStep:
    """One executed step as the runner saw it (chunk_signature) and its modelled seconds."""

    chunks: tuple[tuple[str, int, int], ...]
    modelled_s: float


class SimulatedRunner:
    """What EngineCore needs of a ModelRunner: execute() and the replica's shape.

    time_scale multiplies every wait (0: no waiting, for replaying schedules
    faster than real time). record=True keeps every step's ScheduledStep in
    `steps` (for comparing schedules; it grows without bound). shared_device: the
    device this replica shares with others (None: a device of its own)."""

    def __init__(self, cost: CostModel, *, num_blocks: int, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None = None, time_scale: float = 1.0, record: bool = False,
                 shared_device: SharedDevice | None = None, overlap: bool = False):
        if time_scale < 0:
            raise ValueError("time_scale must be non-negative")
        self.cost = cost
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.time_scale = time_scale
        self.totals = StepFeatures()
        self.modelled_s = 0.0  # sum of every step's modelled time
        self.steps: list[ScheduledStep] | None = [] if record else None
        self.shared_device = shared_device
        self.overlap = overlap
        # Whether the next step follows the previous one at once (the engine had
        # work left), so its host work overlapped that step (follows_previous).
        self.back_to_back = False
        self._previous_end: float | None = None   # monotonic end of the previous step's device work
        self._previous_wall = 0.0                 # that step's device wall time

    def set_eos_token_ids(self, ids) -> None:
        """Rule tokens are not sampled: nothing masks EOS."""

    def release(self, seq) -> None:
        """Nothing is held per sequence."""

    def execute(self, chunks) -> SamplerOutput:
        """One token per chunk that reaches its sequence's last known token, in chunk order."""
        features = features_of(chunks)
        seconds = self.cost.time_of(features)
        self.totals += features
        self.modelled_s += seconds
        if self.steps is not None:
            self.steps.append(ScheduledStep(chunk_signature(chunks), seconds))
        sampled = [
            rule_token(c.seq.prompt_token_ids, c.seq.num_output_tokens, self.vocab_size)
            for c in chunks if c.seq.num_computed_tokens + c.num_tokens == c.seq.num_tokens
        ]
        self._wait(seconds)
        return SamplerOutput(sampled, None)

    def _wait(self, seconds: float) -> None:
        if not self.time_scale:
            return
        called = time.monotonic()
        ahead = 0.0   # wall seconds of this step's device work done before the call
        if self.overlap and self.back_to_back and self._previous_end is not None:
            ahead = max(0.0, min(called - self._previous_end, self._previous_wall))
        if self.shared_device is not None:
            if ahead:   # done at the share of the moment: this one and those in a step now
                seconds -= ahead / self.time_scale / (1 + self.shared_device.running_count())
            self.shared_device.run_step(seconds, self.time_scale)
        else:
            left = seconds * self.time_scale - ahead
            if left > 0:
                time.sleep(left)
        end = time.monotonic()
        self._previous_end, self._previous_wall = end, end - called + ahead

    def follows_previous(self, back_to_back: bool) -> None:
        """The engine's word before each step: whether it follows the previous one at once."""
        self.back_to_back = back_to_back

    def idle(self) -> None:
        """A step launched nothing: the next one overlaps no device work."""
        self._previous_end = None

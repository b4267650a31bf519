"""The engine core: a replica's scheduler, model runner and detokenizers, with no networking.

A worker drives it with add_request / abort_request / step; admission_capacity
says how much more it can take right now (what the worker asks the router for).

A step is launched, then resolved. Launching schedules it, queues it on the
device and advances its sequences at once: computed tokens move on, and each
sampled token is appended as a placeholder (sequence.py). Resolving reads the
sampled ids back, fills the placeholders, caches the step's full blocks, and
applies stop conditions and detokenization. With async scheduling (on CUDA by
default) a step's resolution waits until the next step is launched, so the
host's scheduling and input preparation run while the device computes, and
the next step reads the tokens it needs from the device. The costs: a sequence
that stops on a token (EOS, a stop string) runs one step more, whose row is
dropped; one whose last token is in flight (max_tokens, the model's length)
is not scheduled again. Rows with penalties need their counts on the host, so
while such a request runs, steps resolve before the next is scheduled.
The prefix cache's counters, events and snapshot (prefix_cache_stats,
take_kv_events, cached_block_hashes, block_hasher) let a router mirror it.
Not thread-safe: one thread owns an EngineCore.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.block_hash import BlockHasher
from replica_worker.engine.config import EngineConfig
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.model_runner import ModelRunner
from replica_worker.engine.output_text import OutputTexts
from replica_worker.engine.outputs import DeltaStats, EngineLoad, RequestDelta, StepResult, TokenLogprobs
from replica_worker.engine.sampler import SampledBatch, SamplerOutput
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers import make_scheduler
from replica_worker.engine.schedulers.base import AdmissionCapacity, ScheduledChunk
from replica_worker.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def _eos_ids(*sources) -> frozenset[int]:
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


@dataclass
class _Launched:
    """A step queued on the device whose sampled ids are not read yet."""

    chunks: list[ScheduledChunk]
    samples: list[bool]  # per chunk: it samples a token (read before launching advanced it)
    sampled: SampledBatch | SamplerOutput | None  # a runner without launch() gives host ids

    def token_ids(self) -> SamplerOutput:
        if isinstance(self.sampled, SampledBatch):
            return self.sampled.to_host()
        return self.sampled or SamplerOutput([])


class EngineCore:
    def __init__(self, config: EngineConfig, tokenizer=None, runner=None):
        """runner: what runs the batches (ModelRunner(config) when not given; a
        simulated replica gives one that waits instead of computing)."""
        self.config = config
        self._tensor_parallel = None
        if runner is not None:
            self.runner = runner
        else:
            if config.parallel.tensor_parallel_size > 1:
                from replica_worker.engine.distributed.leader import TensorParallelLeader

                self._tensor_parallel = TensorParallelLeader(config)  # this process is rank 0
            try:
                self.runner = ModelRunner(config, self._tensor_parallel and self._tensor_parallel.ranks)
            except BaseException:
                self._abort_ranks("rank 0 failed to start its runner")
                raise
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.scheduler = make_scheduler(
            config.scheduler, config.cache, self.runner.num_blocks, self.max_model_len,
            getattr(self.runner, "sliding_window", None),
        )
        if not self.scheduler.can_ever_fit(self.max_model_len):
            # A request that leaves max_tokens out is given the length its prompt
            # leaves: some such requests will be refused here.
            logger.warning(
                "the KV cache (%d blocks of %d tokens) cannot hold one request of the model's "
                "whole length (%d tokens): longer requests are refused; raise num_blocks or the "
                "cache's memory", self.runner.num_blocks, config.cache.block_size, self.max_model_len)
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_ids(
            self.runner.eos_token_id, getattr(tokenizer, "eos_token_id", None)
        )
        self._texts = OutputTexts(tokenizer) if tokenizer is not None else None
        self._step_id = 0
        self._in_flight: _Launched | None = None
        self._undelivered: list[RequestDelta] = []   # resolved by a step whose launch then failed
        async_scheduling = config.async_scheduling
        if async_scheduling is None:
            async_scheduling = config.device != "cpu"
        # Tensor-parallel ranks take token ids from rank 0's host; runners without
        # launch() (simulated ones) return host ids at once.
        self._async = bool(async_scheduling) and self._tensor_parallel is None and hasattr(self.runner, "launch")
        # Requests whose sampling reads their earlier tokens on the host (penalties).
        self._needs_resolved_tokens: set[str] = set()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        # The sampler needs them too: min_tokens keeps EOS from being sampled.
        self._eos_token_ids = frozenset(ids)
        self.runner.set_eos_token_ids(self._eos_token_ids)

    # ---- requests in ----
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        resume_token_ids: list[int] | None = None,
        resume_text_len: int | None = None,
    ) -> Sequence:
        """Queues a request; raises InvalidRequestError saying what is wrong."""
        resume = list(resume_token_ids or ())
        self._validate(request_id, prompt_token_ids, params, resume)
        seq = Sequence(
            request_id, prompt_token_ids, params, arrival_time=arrival_time, resume_token_ids=resume
        )
        if self._texts is not None:
            self._texts.add(request_id, seq.output_token_ids, params, resume_text_len, prompt_token_ids)
        if params.uses_penalties:
            self._needs_resolved_tokens.add(request_id)
        self.scheduler.add_seq(seq)
        return seq

    def _validate(self, request_id, prompt, params: SamplingParams, resume: list[int]) -> None:
        if not request_id:
            raise InvalidRequestError("request_id must not be empty")
        if self.scheduler.get_seq(request_id) is not None:
            raise InvalidRequestError(f"request_id {request_id!r} is already running on this engine")
        if not prompt:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if params.n != 1:
            raise InvalidRequestError(
                f"n is {params.n}: the engine runs one sequence per request id; give each "
                "completion its own request (LLM.generate expands n)")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(
                f"logprobs {params.logprobs} exceeds the vocabulary size {self.vocab_size}")
        context = len(prompt) + len(resume)
        if context >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {context} tokens; the model allows {self.max_model_len} "
                "in all, so the prompt must be shorter to leave room for output"
            )
        bad = [t for t in (*prompt, *resume) if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if params.logit_bias and params.logit_bias[-1][0] >= self.vocab_size:   # sorted pairs
            raise InvalidRequestError(
                f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary "
                f"[0, {self.vocab_size})")
        if params.max_tokens is not None and len(resume) >= params.max_tokens:
            raise InvalidRequestError("resume_token_ids already reach max_tokens")
        longest = min(self.max_model_len, len(prompt) + (params.max_tokens or self.max_model_len))
        if not self.scheduler.can_ever_fit(longest):
            raise InvalidRequestError(
                f"a request of up to {longest} tokens can never fit in this replica's KV cache"
            )

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.abort_seq(request_id)
        self._forget(request_id)
        if seq is not None:
            self.runner.release(seq)  # a row of it still in flight is dropped when resolved
        return seq is not None

    # ---- the step ----
    @property
    def async_scheduling(self) -> bool:
        return self._async

    def set_async_scheduling(self, on: bool) -> None:
        """Turns async scheduling on or off between steps (side-by-side runs)."""
        if self._in_flight is not None:
            raise RuntimeError("a step is in flight: switch between steps with nothing running")
        if on and (self._tensor_parallel is not None or not hasattr(self.runner, "launch")):
            raise ValueError("async scheduling needs a single-rank engine whose runner has launch()")
        self._async = bool(on)

    def step(self) -> StepResult:
        """Launches the next step; returns the deltas of the step resolved meanwhile
        (this one, or with async scheduling the one before it)."""
        start = time.perf_counter()
        self._step_id += 1
        deltas, self._undelivered = self._undelivered, []
        if self._in_flight is not None and self._needs_resolved_tokens:
            deltas.extend(self._resolve(self._take_in_flight()))
        out = self.scheduler.schedule()
        deltas.extend(self._ignored_delta(seq) for seq in out.ignored)
        try:
            launched = self._launch(out.chunks) if out.chunks else None
        except BaseException:
            # What this step resolved before its launch failed (requests it ended
            # among them) still goes out: take_undelivered, or the next step.
            self._undelivered = deltas
            raise
        if self._in_flight is not None:
            deltas.extend(self._resolve(self._take_in_flight()))
        if launched is not None:
            if self._async:
                self._in_flight = launched
                self._hold_last_tokens(launched)
            else:
                deltas.extend(self._resolve(launched))
        return StepResult(
            deltas=deltas,
            batch_size=len(out.chunks),
            num_tokens=out.num_batched_tokens,
            num_preempted=len(out.preempted),
            step_time=time.perf_counter() - start,
        )

    def take_undelivered(self) -> list[RequestDelta]:
        """Deltas a failed step had resolved before its launch failed; once."""
        deltas, self._undelivered = self._undelivered, []
        return deltas

    def _launch(self, chunks: list[ScheduledChunk]) -> _Launched:
        samples = [c.samples for c in chunks]  # before num_computed_tokens moves
        previous = self._in_flight.sampled if self._in_flight is not None else None
        try:
            if hasattr(self.runner, "launch"):
                sampled = self.runner.launch(chunks, previous if isinstance(previous, SampledBatch) else None)
            else:
                sampled = self.runner.execute(chunks)
        except BaseException:
            # The other ranks may be inside this step's collectives: no later step could pair with them.
            self._abort_ranks("a step failed on rank 0")
            if self._in_flight is not None:
                # Its tokens were never read: undone, so the engine stays whole and
                # computes them again if it goes on (a worker hands everything back).
                self._roll_back(self._take_in_flight())
            raise
        row = 0
        for chunk, sampling in zip(chunks, samples):
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            if sampling:
                seq.append_placeholder(row)
                row += 1
        return _Launched(chunks, samples, sampled)

    def _roll_back(self, launched: _Launched) -> None:
        """The state before `launched`: its placeholders dropped, its computed tokens
        uncounted (a sequence preempted since has none to uncount). Under a sliding
        window the blocks its chunks read may have been given back since
        (BlockManager.release_out_of_window), so computing them again here would read
        the null block: every caller aborts the requests after a failed step instead
        (the worker hands them back, LLM.generate aborts what is unfinished)."""
        for chunk in launched.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            seq.drop_placeholders()
            seq.last_token_in_flight = False
            seq.num_computed_tokens = max(0, seq.num_computed_tokens - chunk.num_tokens)

    def _take_in_flight(self) -> _Launched:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _hold_last_tokens(self, launched: _Launched) -> None:
        """A sequence whose token in flight is its last is not scheduled again."""
        for chunk, sampling in zip(launched.chunks, launched.samples):
            seq = chunk.seq
            if sampling and not seq.is_finished and self._length_reached(seq, seq.num_output_tokens, seq.num_tokens):
                seq.last_token_in_flight = True

    def _resolve(self, launched: _Launched) -> list[RequestDelta]:
        sampled = launched.token_ids()
        now = time.time()
        deltas = []
        row = 0
        for chunk, sampling in zip(launched.chunks, launched.samples):
            seq = chunk.seq
            if sampling:
                row += 1
            if seq.is_finished:  # aborted, or stopped by the token before (its row is dropped)
                continue
            if not sampling:
                self.scheduler.cache_computed(seq)
                continue
            token = sampled.token_ids[row - 1]
            logprobs = sampled.logprobs[row - 1] if sampled.logprobs is not None else None
            offset = len(seq.output_token_ids)
            seq.resolve_placeholder(token, now)
            self.scheduler.cache_computed(seq)  # every computed token is known now
            deltas.append(self._delta_after_token(seq, token, logprobs, offset, now))
            assert seq.is_finished or not seq.last_token_in_flight, f"{seq} held back but not finished"
        return deltas

    def _delta_after_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                           offset: int, now: float) -> RequestDelta:
        status = self._stop_status(seq, token)
        text = ""
        if self._texts is not None:
            text, stop_string_hit = self._texts.step(
                seq.seq_id, len(seq.output_token_ids), final=status is not None,
                stop_token=status is SequenceStatus.FINISHED_STOPPED)
            if stop_string_hit:
                status = SequenceStatus.FINISHED_STOPPED
        delta = RequestDelta(seq.seq_id, [token], text, offset, stats=DeltaStats.of(seq, 1),
                             logprobs=None if logprobs is None else [logprobs])
        if status is not None:
            self._finish(seq, status, now)
            delta.finish_reason = status.value
        return delta

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """After `token` was resolved (later placeholders, if any, do not count)."""
        params = seq.sampling_params
        num_output = len(seq.output_token_ids)
        # Before min_tokens the sampler masks EOS and stop ids; this keeps the rule if one slipped through.
        if num_output > params.min_tokens:
            if not params.ignore_eos and token in self._eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if self._length_reached(seq, num_output, seq.num_prompt_tokens + num_output):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _length_reached(self, seq: Sequence, num_output: int, num_tokens: int) -> bool:
        max_tokens = seq.sampling_params.max_tokens
        return (max_tokens is not None and num_output >= max_tokens) or num_tokens >= self.max_model_len

    def _finish(self, seq: Sequence, status: SequenceStatus, now: float) -> None:
        seq.drop_placeholders()  # a step launched after this token computed past the end
        seq.finish(status, now)
        self.scheduler.free_finished(seq)
        self.runner.release(seq)
        self._forget(seq.seq_id)

    def _forget(self, request_id: str) -> None:
        self._needs_resolved_tokens.discard(request_id)
        if self._texts is not None:
            self._texts.remove(request_id)

    def _ignored_delta(self, seq: Sequence) -> RequestDelta:
        self._forget(seq.seq_id)
        return RequestDelta(
            seq.seq_id, [], "", seq.num_output_tokens, finish_reason="error",
            error="request can never be scheduled on this replica (too long for its KV cache)",
            stats=DeltaStats.of(seq, 0),
        )

    @property
    def tensor_parallel(self):
        """The TensorParallelLeader when this engine spans several ranks, else None."""
        return self._tensor_parallel

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks, if any (also done at interpreter exit)."""
        if self._tensor_parallel is not None:
            self._tensor_parallel.shutdown()

    def _abort_ranks(self, reason: str) -> None:
        if self._tensor_parallel is not None:
            self._tensor_parallel.abort(reason)

    @property
    def step_errors_recoverable(self) -> bool:
        """False under tensor parallelism: a step that failed on rank 0 may have left the
        other ranks inside a collective, so no later step can be trusted."""
        return self._tensor_parallel is None

    # ---- what the worker asks ----
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    def admission_capacity(self) -> AdmissionCapacity:
        return self.scheduler.admission_capacity()

    def load(self) -> EngineLoad:
        bm = self.scheduler.block_manager
        return EngineLoad(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            free_kv_blocks=bm.num_free_blocks,
            total_kv_blocks=bm.num_total_blocks,
        )

    # ---- the prefix cache, for a router that mirrors it ----
    @property
    def prefix_caching_enabled(self) -> bool:
        return self.scheduler.block_manager.enable_prefix_caching

    @property
    def block_hasher(self) -> BlockHasher:
        """Scheme name, block size and salt: what a router needs to compute this
        cache's block hashes from a request's tokens (common/block_hash.py)."""
        return self.scheduler.block_manager.hasher

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.scheduler.block_manager.prefix_cache_stats()

    def take_kv_events(self) -> KVCacheEvents:
        """Block hashes stored and evicted since the last call, which it clears.
        Call it after step(); `cleared` says to replace the mirror by `stored`."""
        return self.scheduler.block_manager.take_kv_events()

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the cache holds now (in use or evictable)."""
        return self.scheduler.block_manager.cached_block_hashes()

    @property
    def step_id(self) -> int:
        return self._step_id

    def request_ids(self) -> list[str]:
        return [s.seq_id for s in (*self.scheduler.running, *self.scheduler.waiting)]

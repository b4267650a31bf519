"""The engine core: a replica's scheduler, model runner and detokenizers, with no networking.

A worker drives it with add_request / abort_request / step; admission_capacity
says how much more it can take right now (what the worker asks the router for).
The prefix cache's counters, events and snapshot (prefix_cache_stats,
take_kv_events, cached_block_hashes, block_hasher) let a router mirror it.
Not thread-safe: one thread owns an EngineCore.
"""

from __future__ import annotations

import time

from common.block_hash import BlockHasher
from replica_worker.engine.config import EngineConfig
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.model_runner import ModelRunner
from replica_worker.engine.output_text import OutputTexts
from replica_worker.engine.outputs import DeltaStats, EngineLoad, RequestDelta, StepResult, TokenLogprobs
from replica_worker.engine.sampler import SamplerOutput
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers import make_scheduler
from replica_worker.engine.schedulers.base import AdmissionCapacity, ScheduledChunk
from replica_worker.engine.sequence import Sequence, SequenceStatus


def _eos_ids(*sources) -> frozenset[int]:
    ids: set[int] = set()
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


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
            config.scheduler, config.cache, self.runner.num_blocks, self.max_model_len
        )
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_ids(
            self.runner.eos_token_id, getattr(tokenizer, "eos_token_id", None)
        )
        self._texts = OutputTexts(tokenizer) if tokenizer is not None else None
        self._step_id = 0

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
            self._texts.add(request_id, seq.output_token_ids, params, resume_text_len)
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
        if params.max_tokens is not None and len(resume) >= params.max_tokens:
            raise InvalidRequestError("resume_token_ids already reach max_tokens")
        longest = min(self.max_model_len, len(prompt) + (params.max_tokens or self.max_model_len))
        if not self.scheduler.can_ever_fit(longest):
            raise InvalidRequestError(
                f"a request of up to {longest} tokens can never fit in this replica's KV cache"
            )

    def abort_request(self, request_id: str) -> bool:
        seq = self.scheduler.abort_seq(request_id)
        self._forget_text(request_id)
        if seq is not None:
            self.runner.release(seq)
        return seq is not None

    # ---- the step ----
    def step(self) -> StepResult:
        start = time.perf_counter()
        self._step_id += 1
        out = self.scheduler.schedule()
        deltas = [self._ignored_delta(seq) for seq in out.ignored]
        if out.chunks:
            try:
                sampled = self.runner.execute(out.chunks)
            except BaseException:
                # The other ranks may be inside this step's collectives: no later step could pair with them.
                self._abort_ranks("a step failed on rank 0")
                raise
            deltas.extend(self._apply(out.chunks, sampled))
        return StepResult(
            deltas=deltas,
            batch_size=len(out.chunks),
            num_tokens=out.num_batched_tokens,
            num_preempted=len(out.preempted),
            step_time=time.perf_counter() - start,
        )

    def _apply(self, chunks: list[ScheduledChunk], sampled: SamplerOutput) -> list[RequestDelta]:
        now = time.time()
        deltas = []
        row = 0
        for chunk in chunks:
            seq = chunk.seq
            samples = chunk.samples  # read before advancing num_computed_tokens
            seq.num_computed_tokens += chunk.num_tokens
            self.scheduler.cache_computed(seq)
            if not samples:
                continue
            token = sampled.token_ids[row]
            logprobs = sampled.logprobs[row] if sampled.logprobs is not None else None
            row += 1
            offset = seq.num_output_tokens
            seq.append_token(token, now)
            deltas.append(self._delta_after_token(seq, token, logprobs, offset, now))
        return deltas

    def _delta_after_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None,
                           offset: int, now: float) -> RequestDelta:
        status = self._stop_status(seq, token)
        text = ""
        if self._texts is not None:
            text, stop_string_hit = self._texts.step(seq.seq_id, seq.num_output_tokens, final=status is not None)
            if stop_string_hit:
                status = SequenceStatus.FINISHED_STOPPED
        delta = RequestDelta(seq.seq_id, [token], text, offset, stats=DeltaStats.of(seq, 1),
                             logprobs=None if logprobs is None else [logprobs])
        if status is not None:
            self._finish(seq, status, now)
            delta.finish_reason = status.value
        return delta

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        params = seq.sampling_params
        # Before min_tokens the sampler masks EOS and stop ids; this keeps the rule if one slipped through.
        if seq.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token in self._eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _finish(self, seq: Sequence, status: SequenceStatus, now: float) -> None:
        seq.finish(status, now)
        self.scheduler.free_finished(seq)
        self.runner.release(seq)
        self._forget_text(seq.seq_id)

    def _forget_text(self, request_id: str) -> None:
        if self._texts is not None:
            self._texts.remove(request_id)

    def _ignored_delta(self, seq: Sequence) -> RequestDelta:
        self._forget_text(seq.seq_id)
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
        return self.scheduler.has_unfinished

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

"""msgpack encoding of what crosses between a worker and its engine process.

Commands go down (AddRequest, AbortRequest, ReportNow, and Stop); an
EngineInfo comes up once, then one EngineReport per engine iteration. Every
message is a list whose first item names its kind. Only plain values cross:
numbers, strings, bytes, lists.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from operator import attrgetter

import msgpack

from common.block_hash import BlockHasher
from replica_worker.engine.kv_events import KVCacheEvents, PrefixCacheStats
from replica_worker.engine.outputs import DeltaStats, EngineLoad, RequestDelta, StepResult, TokenLogprobs
from replica_worker.engine.sampling_params import SamplingParams
from replica_worker.engine.schedulers.base import AdmissionCapacity
from replica_worker.worker.engine_loop import AbortRequest, AddRequest, EngineReport, ReportNow

_SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
# A delta's figures as a flat tuple: dataclasses.astuple deep-copies each field
# and made a 256-delta report's encoding 12x dearer
# (python -m benchmarks.engine.report_encoding).
_stats_row = attrgetter(*(f.name for f in fields(DeltaStats)))


@dataclass(frozen=True)
class Stop:
    """The worker is done with its engine: the process ends."""


@dataclass(frozen=True)
class EngineInfo:
    """What a worker reads of its engine before the engine's thread starts."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_batch_tokens: int
    max_model_len: int
    hasher: BlockHasher | None  # None: the engine keeps no prefix cache
    cached_block_hashes: tuple[int, ...]

    @classmethod
    def of(cls, engine) -> "EngineInfo":
        """Of an EngineCore (or one that looks like it), on the thread that owns it."""
        sched = engine.config.scheduler
        caching = engine.prefix_caching_enabled
        return cls(num_kv_blocks=engine.runner.num_blocks, block_size=engine.config.cache.block_size,
                   max_num_seqs=sched.max_num_seqs, max_batch_tokens=sched.chunk_size,
                   max_model_len=engine.max_model_len, hasher=engine.block_hasher if caching else None,
                   cached_block_hashes=tuple(engine.cached_block_hashes()) if caching else ())


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)


# ---- commands ----
def encode_command(cmd) -> bytes:
    if isinstance(cmd, AddRequest):
        params = [getattr(cmd.params, name) for name in _SAMPLING_FIELDS]
        return _pack(["add", cmd.request_id, cmd.prompt_token_ids, params, cmd.arrival_time,
                      list(cmd.resume_token_ids), cmd.resume_text_len])
    if isinstance(cmd, AbortRequest):
        return _pack(["abort", cmd.request_id])
    if isinstance(cmd, ReportNow):
        return _pack(["report"])
    if isinstance(cmd, Stop):
        return _pack(["stop"])
    raise TypeError(f"not an engine command: {cmd!r}")


def decode_command(data: bytes):
    msg = _unpack(data)
    kind = msg[0]
    if kind == "add":
        _, rid, prompt, params, arrival, resume, resume_text_len = msg
        return AddRequest(rid, prompt, SamplingParams(**dict(zip(_SAMPLING_FIELDS, params))), arrival,
                          tuple(resume), resume_text_len)
    if kind == "abort":
        return AbortRequest(msg[1])
    if kind == "report":
        return ReportNow()
    if kind == "stop":
        return Stop()
    raise ValueError(f"unknown engine command {kind!r}")


# ---- the engine's start-up ----
def encode_info(info: EngineInfo) -> bytes:
    h = info.hasher
    hasher = None if h is None else [h.block_size, h.salt, h.scheme]
    return _pack(["info", info.num_kv_blocks, info.block_size, info.max_num_seqs, info.max_batch_tokens,
                  info.max_model_len, hasher, list(info.cached_block_hashes)])


def decode_info(data: bytes) -> EngineInfo:
    kind, blocks, block_size, seqs, batch_tokens, max_len, hasher, cached = _unpack(data)
    if kind != "info":
        raise ValueError(f"expected the engine's info, got {kind!r}")
    return EngineInfo(blocks, block_size, seqs, batch_tokens, max_len,
                      None if hasher is None else BlockHasher(*hasher), tuple(cached))


# ---- reports ----
def _delta(d: RequestDelta) -> list:
    logprobs = None if d.logprobs is None else [[e.logprob, [list(t) for t in e.top]] for e in d.logprobs]
    stats = None if d.stats is None else _stats_row(d.stats)
    return [d.request_id, d.new_token_ids, d.text, d.output_offset, d.finish_reason, d.error, logprobs, stats]


def _delta_from(row: list) -> RequestDelta:
    rid, tokens, text, offset, finish, error, logprobs, stats = row
    if logprobs is not None:
        logprobs = [TokenLogprobs(lp, tuple((t, v) for t, v in top)) for lp, top in logprobs]
    if stats is not None:
        stats[6] = tuple(stats[6])  # token_times
        stats = DeltaStats(*stats)
    return RequestDelta(rid, tokens, text, offset, finish, error, stats, logprobs)


def encode_report(report: EngineReport) -> bytes:
    r = report.result
    kv = report.kv_events
    return _pack([
        "step",
        [[_delta(d) for d in r.deltas], r.batch_size, r.num_tokens, r.num_preempted, r.step_time],
        list(astuple(report.capacity)),
        list(astuple(report.load)),
        list(report.request_ids),
        report.step_id,
        list(report.handed_back),
        None if kv is None else [list(kv.stored), list(kv.evicted), kv.cleared],
        None if report.prefix_stats is None else list(astuple(report.prefix_stats)),
    ])


def decode_report(data: bytes) -> EngineReport:
    kind, result, capacity, load, request_ids, step_id, handed_back, kv, prefix = _unpack(data)
    if kind != "step":
        raise ValueError(f"expected an engine report, got {kind!r}")
    deltas, batch_size, num_tokens, num_preempted, step_time = result
    return EngineReport(
        result=StepResult([_delta_from(d) for d in deltas], batch_size, num_tokens, num_preempted, step_time),
        capacity=AdmissionCapacity(*capacity),
        load=EngineLoad(*load),
        request_ids=tuple(request_ids),
        step_id=step_id,
        handed_back=tuple(handed_back),
        kv_events=None if kv is None else KVCacheEvents(tuple(kv[0]), tuple(kv[1]), kv[2]),
        prefix_stats=None if prefix is None else PrefixCacheStats(*prefix),
    )

"""Startup recovery from Redis, and the reaper.

At start every live request (Redis's `live` set) is loaded: a queued one goes
to the shared queue (per-replica policies re-place it once replicas join); a
running one becomes DETACHED with a fresh lease of lease_ttl, long enough for
its replica to notice the new router and re-register holding it (then it
runs on with nothing recomputed). Queue members and in-flight entries of no
live request are removed.

The reaper, every heartbeat interval: drops replicas silent for a whole lease
(their work is requeued at once), requeues DETACHED requests whose lease ran
out, and renews the Redis leases of live replicas' requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from router.persistence.store import unpack_logprobs, unpack_tokens
from router.requests.request import Phase, RequestState
from router.requests.spec import RequestSpec, sampling_from_fields
from router.scheduling.policies import PENDING

log = logging.getLogger(__name__)


def _f(rec: dict, key: str, default: float = 0.0) -> float:
    value = rec.get(key)
    return float(value) if value not in (None, b"") else default


def state_from_record(rec: dict) -> RequestState:
    """A request as Redis records it."""
    sampling = sampling_from_fields(json.loads(rec.get("sp", b"{}") or b"{}"))
    spec = RequestSpec(request_id=rec["id"], sampling=sampling, priority=int(_f(rec, "pr")),
                       stream_interval=int(_f(rec, "si")))
    req = RequestState(spec, unpack_tokens(rec.get("p")), rid=rec["id"],
                       digest=rec.get("d", b"").decode(), max_tokens=int(_f(rec, "mt")),
                       arrival=_f(rec, "at"))
    req.submit_token = rec.get("tok", b"").decode()
    req.queue = rec.get("q", b"").decode()
    req.tokens = list(rec["tokens"])
    if spec.sampling.logprobs is not None:
        req.logprobs = unpack_logprobs(rec.get("logprobs"), spec.sampling.logprobs)
    req.cached_tokens = int(_f(rec, "ct"))
    text = rec["text"].decode(errors="replace") if rec["text"] else ""
    req.parts = [text] if text else []
    req.text_bytes = len(rec["text"])
    req.assignments = int(_f(rec, "n"))
    req.requeues = int(_f(rec, "rq"))
    req.assigned_at = _f(rec, "asg")
    req.first_scheduled_at = _f(rec, "fs")
    req.first_token_at = _f(rec, "ft")
    req.last_token_at = req.first_token_at
    req.preemptions = int(_f(rec, "pre"))
    req.replica_id = rec.get("rep", b"").decode()
    if rec.get("st") == b"f":
        req.phase = Phase.FINISHED
        req.finish_reason = int(_f(rec, "fr"))
        req.error = rec.get("err", b"").decode()
        req.finished_at = _f(rec, "fin")
        req.visible_tokens, req.visible_parts = len(req.tokens), len(req.parts)
        req.finish_visible = True
    return req


async def recover(table, store, writer, lease_ttl: float) -> int:
    """Loads every unfinished request from Redis; returns how many."""
    ids = await store.live_ids()
    records = await store.load_requests(ids)
    now = time.time()
    leases, moves = {}, []
    for rid, rec in zip(ids, records):
        if rec is None or rec.get("st") == b"f":
            continue
        req = state_from_record(rec)
        state, owner = rec.get("st", b"").decode(), rec.get("o", b"").decode()
        if state == "q" and req.queue != PENDING:
            moves += [req.id, "", PENDING]
            req.queue = PENDING
        table.load_recovered(req, state, owner, now)
        if req.phase is Phase.DETACHED:
            leases[req.id] = req.lease_deadline
    if moves:
        writer.post(store.move(moves))
    if leases:
        writer.post(store.ensure_leases(leases))
    strays = await store.stray_members()
    if any(strays):
        await store.remove_strays(*strays)
    log.info("recovered %d requests (%d in flight awaiting their replica)", len(table.requests),
             len(leases))
    return len(table.requests)


class Reaper:
    def __init__(self, table, ops, registry, writer, store, metrics, config):
        self.table = table
        self.ops = ops
        self.registry = registry
        self.writer = writer
        self.store = store
        self.metrics = metrics
        self.config = config
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reaper")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            try:
                self.tick()
            except Exception:
                log.exception("reaper tick failed")

    def tick(self) -> None:
        cfg = self.config
        mono, now = time.monotonic(), time.time()
        for session in list(self.registry.sessions.values()):
            silent = mono - session.last_seen
            if silent > cfg.lease_ttl:
                log.warning("replica %s silent for %.1f s: dropping it", session.id, silent)
                session.close(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no message for {cfg.lease_ttl:g} s (lease_ttl)")
                self.ops.leave(session, True, "lease_expired")
        leases = self.table.running_leases(self.registry.sessions, now)
        if leases:
            self.writer.post(self.store.renew_leases(leases))
        for req in self.table.expired_detached(now):
            self.ops.lease_lapsed(req)
        self.ops.expire_prefix_views(mono)
        index = self.ops.prefix_index
        self.metrics.sync_prefix_index(len(index), index.evictions)
        self.metrics.sync_round_trips(self.writer.round_trips)
        self.metrics.redis_pending.set(self.writer.pending)

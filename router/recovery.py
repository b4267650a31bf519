"""Startup recovery from Redis and the lease reaper.

At start every queued request is re-queued (to "pending", so per-replica
policies re-place it once replicas join); every in-flight request keeps its
lease until it expires, waiting for its owner to re-register and keep it
(Register.held_request_ids). The reaper drops replicas that stay silent for
lease_ttl, requeues orphans whose lease ran out, and renews the Redis leases
of live replicas' requests (so a restarted router knows who is alive).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.policies import PENDING
from router.requests import Phase, RequestState

log = logging.getLogger(__name__)


def _f(rec: dict, key: str, default: float = 0.0) -> float:
    value = rec.get(key)
    return float(value) if value not in (None, b"") else default


def state_from_record(rec: dict) -> RequestState:
    assignment = rpb.Assignment.FromString(rec["a"])
    req = RequestState(assignment, digest=rec.get("d", b"").decode(),
                       max_tokens=int(_f(rec, "mt")), priority=int(_f(rec, "pr")),
                       stream_interval=int(_f(rec, "si")), member=rec.get("m", b"").decode())
    req.tokens = list(rec["tokens"])
    req.parts = [rec["text"]] if rec["text"] else []
    req.requeues = int(_f(rec, "rq"))
    req.assigned_at = _f(rec, "asg")
    req.first_scheduled_at = _f(rec, "fs")
    req.first_token_at = _f(rec, "ft")
    req.last_token_at = req.first_token_at
    req.preemptions = int(_f(rec, "pre"))
    req.replica_id = rec.get("rep", b"").decode()
    if rec.get("st") == b"f":
        req.finish(int(_f(rec, "fr")), rec.get("err", b"").decode(), _f(rec, "fin"))
    return req


async def recover(core) -> int:
    """Loads every unfinished request from Redis; returns how many."""
    queued, inflight = await core.store.live_ids()
    ids = list(dict.fromkeys([*queued, *inflight]))
    records = await core.store.load_requests(ids)
    moves, leases, now = [], {}, time.time()
    for rec in records:
        if rec is None or rec.get("st") == b"f":
            continue
        req = state_from_record(rec)
        core.requests[req.id] = req
        if req.id in inflight and rec.get("st") == b"r":
            req.phase = Phase.RUNNING
            deadline = inflight[req.id]
            core.orphans[req.id] = (rec.get("o", b"").decode(), deadline)
        else:
            core.enqueue_local(req, PENDING)
            if queued.get(req.id) != PENDING:
                moves.append((req.id, PENDING))
    await core.store.move(moves)
    await core.store.renew_leases(leases)
    expired = [rid for rid, (_, deadline) in core.orphans.items() if deadline <= now]
    await core.requeue_orphans(expired)
    log.info("recovered %d requests (%d in flight awaiting their replica)",
             len(core.requests), len(core.orphans))
    return len(core.requests)


class Reaper:
    def __init__(self, core, ops):
        self.core = core
        self.ops = ops
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="reaper")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.core.config.heartbeat_interval)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper tick failed")

    async def tick(self) -> None:
        core, cfg = self.core, self.core.config
        mono, now = time.monotonic(), time.time()
        leases = {}
        for session in list(core.registry.sessions.values()):
            if mono - session.last_seen > cfg.lease_ttl:
                log.warning("replica %s silent for %.1f s: dropping it", session.id,
                            mono - session.last_seen)
                session.close(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no message for {cfg.lease_ttl:g} s (lease_ttl)")
                await self.ops.leave(session, "lease_expired")
                continue
            for rid in session.owned:
                leases[rid] = now + cfg.lease_ttl
        await core.store.renew_leases(leases)
        await core.resync()
        expired = [rid for rid, (_, deadline) in core.orphans.items() if deadline <= now]
        await core.requeue_orphans(expired)
        core.metrics.sync_round_trips(core.store.round_trips)

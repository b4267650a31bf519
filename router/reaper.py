"""The reaper: every heartbeat interval it drops replicas silent for a whole
lease (their work is requeued at once), requeues DETACHED requests whose
lease ran out, renews the Redis leases of live replicas' requests, and
sweeps the in-flight leases of every router (lua_routers.SWEEP_INFLIGHT): a
running request whose lease lapsed while its back router is gone goes back
to the shared queue, with its output so far. It also drops the prefix-cache
views of replicas whose stream broke a lease ago and did not come back
(replicas/ops.py), reads back the requests it fronts that another router
runs and it has heard nothing of for two leases (remote.py:
read_back_silent), and syncs the writer's and the prefix index's gauges.

There is no recovery at start: a router takes in what it does not hold when
it meets it (a pop returns the record, a replica registering with requests
has them adopted, a client re-attaching has the request attached), so any
number of routers can start, stop and die around one Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

log = logging.getLogger(__name__)


class Reaper:
    def __init__(self, table, ops, registry, writer, store, metrics, config, scheduler):
        self.table = table
        self.ops = ops
        self.registry = registry
        self.writer = writer
        self.store = store
        self.metrics = metrics
        self.config = config
        self.scheduler = scheduler
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
        self.writer.post(self.store.sweep_inflight(cfg.lease_ttl)).on_done = self._swept
        self.scheduler.probe_shared_queue()
        # Two leases without news of a request another router runs: read it back.
        self.table.read_back_silent(mono, 2 * cfg.lease_ttl)
        self.ops.expire_prefix_views(mono)
        index = self.ops.prefix_index
        self.metrics.sync_prefix_index(len(index), index.evictions)
        self.metrics.sync_round_trips(self.writer.round_trips)
        self.metrics.redis_pending.set(self.writer.pending)

    def _swept(self, moved) -> None:
        if isinstance(moved, int) and moved:
            log.warning("%d running requests of routers that are gone lost their lease: "
                        "back in the shared queue", moved)
            self.scheduler.work_arrived()

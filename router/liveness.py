"""A router's liveness lease in Redis, and the epoch that fences its writes.

Any number of routers share one Redis. Each life of a router registers a
fresh id with a new epoch and a lease of `ttl` seconds, renewed every
`interval` through the ordered writer, so a renewal that cannot land (Redis
away, or this router frozen) lets the lease lapse. Every write then carries
(id, epoch) and runs only while the lease is live (persistence/lua.py FENCE):
a router that was cut off finds itself FENCED on its first write back and
starts over, instead of overwriting what the others did meanwhile. Each
router also forgets routers whose lease lapsed. A renewal records how many
replicas this router has and learns how many the others have, and how many
other routers there are.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid

log = logging.getLogger(__name__)


class RouterLease:
    def __init__(self, store, writer, ttl: float, interval: float, replica_count=lambda: 0):
        self.store = store
        self.writer = writer
        self.ttl = ttl
        self.interval = interval
        self.replica_count = replica_count
        self.remote_replicas = 0      # replicas of the other live routers, at the last renewal
        self.other_routers: int | None = None   # other live routers then (None: not renewed yet)
        self.router_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.epoch = ""
        self._task: asyncio.Task | None = None

    async def acquire(self) -> None:
        self.epoch = await self.store.register_router(self.router_id, self.ttl)
        self.writer.fence = (self.router_id, self.epoch)
        log.info("router %s holds epoch %s (lease %g s)", self.router_id, self.epoch, self.ttl)

    def start(self) -> None:
        self._renew()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-lease")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._renew()
            self.writer.post(self.store.sweep_routers()).on_done = self._swept

    def _renew(self) -> None:
        self.writer.post(self.store.renew_router(self.ttl, self.replica_count())).on_done = \
            self._renewed

    def _renewed(self, reply) -> None:
        if isinstance(reply, list) and len(reply) == 2:
            self.remote_replicas, self.other_routers = int(reply[0]), int(reply[1])

    @property
    def alone(self) -> bool:
        """Whether the last renewal found no other live router on this Redis."""
        return self.other_routers == 0

    @staticmethod
    def _swept(dead) -> None:
        if isinstance(dead, list) and dead:
            log.warning("routers %s let their lease lapse: forgotten",
                        ", ".join(d.decode() if isinstance(d, bytes) else str(d) for d in dead))

    async def release(self) -> None:
        """Leaves at once (a graceful stop), so no router waits out this lease."""
        await self.stop()
        try:
            await self.store.leave_router(self.router_id)
        except Exception as exc:  # the lease lapses by itself
            log.warning("could not give the router lease up (%s); it lapses in %g s", exc, self.ttl)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

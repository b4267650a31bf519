"""Assigns queued work to replicas with an outstanding Pull.

One task does all assignment, woken by an event (a Pull, an arrival, a
requeue): no timers, no busy loop. The atomic Lua pop makes a request go to
exactly one replica even with several routers on one Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from common.pb.quadriga.v1 import replica_pb2 as rpb
from router.requests import Phase

if TYPE_CHECKING:
    from router.core import RouterCore
    from router.registry import ReplicaSession

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, core: "RouterCore"):
        self.core = core
        self.wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dispatcher")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def kick(self) -> None:
        self.wake.set()

    async def _run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dispatch round failed; retrying on the next event")
                await asyncio.sleep(0.05)
                self.wake.set()

    async def _round(self) -> None:
        progress = True
        while progress:
            progress = False
            for session in self.core.registry.pullers():
                queue = self.core.policy.pull_queue(session)
                if self.core.queued_counts.get(queue, 0) > 0 and session.wants_work:
                    progress |= await self._serve(session, queue)

    async def _serve(self, session: "ReplicaSession", queue: str) -> bool:
        core = self.core
        now = time.time()
        tokens = None if session.pull_unlimited_tokens else session.pull_tokens
        try:
            ids = await core.store.pop(queue, session.id, session.pull_requests, tokens,
                                       now + core.config.lease_ttl, now)
        except Exception as exc:
            # The pop may have run with its reply lost: put this queue's requests
            # back in Redis as memory has them (the reaper rewrites them).
            core.mark_dirty([r for r in core.requests.values()
                             if r.phase is Phase.QUEUED and r.queue == queue and r.member], exc)
            raise
        if not ids:
            return False
        assign = rpb.Assign()
        stale = []
        for rid in ids:
            req = core.requests.get(rid)
            if req is None or req.phase is not Phase.QUEUED:
                stale.append(rid)  # cancelled while the pop was in flight
                continue
            core.assign_local(req, session)
            session.pull_requests -= 1
            # An overrun (see lua.POP) is not carried into the next grant: the
            # replica's capacity already counts the request it started.
            session.pull_tokens = max(0, session.pull_tokens - req.context_len)
            a = assign.assignments.add()
            a.CopyFrom(req.assignment)
            if req.tokens:
                a.resume_token_ids.extend(req.tokens)
                # Characters (code points) delivered; only requeued requests pay for the sum.
                a.resume_text_len = sum(map(len, req.parts))
        if stale:
            await core.discard_popped(stale)
        if session.closed:
            # The replica went away during the pop: its new work goes straight back.
            await core.requeue_owned(session, list(session.owned.values()), "replica_gone")
            return True
        if assign.assignments:
            session.send(rpb.RouterMessage(assign=assign))
        return True

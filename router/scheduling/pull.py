"""The pull scheduler: owns every replica's pull credit and assigns queued work
against it, asking the policy which queue each puller takes from.

One task does all assignment, woken by an event (a Pull, a confirmed
arrival, a requeue): no timers, no busy loop. Pops go through the ordered
Redis writer, so a stalled Redis pauses dispatch and nothing else. The atomic
Lua pop gives each request to exactly one replica. An Assign is sent the
moment its pop returns, before anything else is done.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from router.requests.request import Phase
from router.scheduling.credit import Credit
from router.scheduling.policies import PENDING, make_policy, replica_queue

log = logging.getLogger(__name__)


class PullScheduler:
    def __init__(self, table, store, writer, policy_name: str, lease_ttl: float):
        self.table = table
        self.store = store
        self.writer = writer
        self.lease_ttl = lease_ttl
        self.policy = make_policy(policy_name, self)
        self._credit: dict[str, Credit] = {}
        self._sessions: dict[str, object] = {}   # replica id -> its live session handle
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._pop_ids = itertools.count()
        self._pop_prefix = uuid.uuid4().hex[:12]
        self.paused = False

    # ---- what the policy context offers ----
    def load_of(self, replica_id: str) -> int:
        return self.table.load_of(replica_id)

    # ---- membership ----
    def attach(self, session) -> None:
        """A replica session joined (or replaced its previous session)."""
        cap = session.capacity
        limit = cap.max_num_seqs + cap.prefetch if cap.max_num_seqs else 0
        self._sessions[session.id] = session
        self._credit[session.id] = Credit(seat_limit=limit)
        self.policy.on_replica_joined(session)
        if self.policy.per_replica_queues:
            self.redistribute(PENDING)
        self.kick()

    def detach(self, session) -> None:
        """A session ended: its credit goes with it, its queue is re-placed."""
        if self._sessions.get(session.id) is not session:
            return
        del self._sessions[session.id]
        del self._credit[session.id]
        self.policy.on_replica_left(session)
        if self.policy.per_replica_queues:
            self.redistribute(replica_queue(session.id))

    def draining(self, session) -> None:
        if self.policy.per_replica_queues:
            self.redistribute(replica_queue(session.id))

    def live(self, exclude: str | None = None) -> list:
        return [s for s in self._sessions.values()
                if not s.closed and not s.draining and s.id != exclude]

    # ---- placement ----
    def arrival_queue(self, cost: int) -> str:
        target = self.policy.select(cost, self.live())
        return replica_queue(target.id) if target else PENDING

    def requeue_queue(self, cost: int, leaving: str | None) -> str:
        target = self.policy.select(cost, self.live(exclude=leaving))
        return replica_queue(target.id) if target else PENDING

    def redistribute(self, queue: str) -> None:
        """Re-places the requests waiting in `queue` through the policy."""
        exclude = queue[2:] if queue.startswith("r:") else None
        for req in self.table.queued_in(queue):
            dest = self.requeue_queue(req.cost, exclude)
            if dest != queue:
                self.table.move(req, dest)

    # ---- credit ----
    def on_pull(self, session, max_requests: int, max_prompt_tokens: int | None) -> None:
        credit = self._credit.get(session.id)
        if credit is None or self._sessions.get(session.id) is not session:
            return
        credit.grant(max_requests, max_prompt_tokens)
        self.kick()

    def credit_of(self, replica_id: str) -> Credit | None:
        return self._credit.get(replica_id)

    # ---- the dispatch loop ----
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pull-scheduler")

    async def stop(self) -> None:
        """Stops assigning; an Assign whose pop is in flight is still sent."""
        self.paused = True
        if self._task is not None:
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.lease_ttl)
            except asyncio.TimeoutError:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def kick(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while not self.paused:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dispatch round failed; retrying on the next event")
                await asyncio.sleep(0.05)
                self._wake.set()

    def _pullers(self) -> list:
        """Sessions with credit they can use, oldest Pull first."""
        out = []
        for rid, session in self._sessions.items():
            credit = self._credit[rid]
            if not session.closed and not session.draining and \
                    credit.wants_work(len(self.table.owned_by(rid))):
                out.append((credit.pulled_at, session))
        return [s for _, s in sorted(out, key=lambda x: x[0])]

    async def _round(self) -> None:
        progress = True
        while progress and not self.paused:
            progress = False
            for session in self._pullers():
                queue = self.policy.pull_queue(session)
                if self.table.queued_count(queue) > 0:
                    progress |= await self._serve(session, queue)

    async def _serve(self, session, queue: str) -> bool:
        credit = self._credit[session.id]
        seats = credit.seats(len(self.table.owned_by(session.id)))
        now = time.time()
        token = f"{self._pop_prefix}:{next(self._pop_ids)}"
        ids = await self.writer.call(self.store.pop(
            queue, session.id, seats, credit.token_limit, now + self.lease_ttl, now, token))
        if not ids:
            return False
        taken = []
        for raw in ids:
            rid = raw.decode()
            req = self.table.get(rid)
            if req is None:
                log.error("popped %s, which this router does not hold; its lease will lapse", rid)
                continue
            if req.phase is not Phase.QUEUED:
                continue  # cancelled or withdrawn while the pop was in flight; Redis follows
            self.table.assign(req, session.id)
            if self._credit.get(session.id) is credit:
                credit.spend(req.context_len)
            taken.append(req)
        if not taken:
            return True
        if session.closed or self._sessions.get(session.id) is not session:
            # The replica went away during the pop: it never saw this work.
            for req in taken:
                self.table.requeue(req, self.requeue_queue(req.cost, session.id), "replica_gone")
            return True
        session.send_assignments(taken)
        return True

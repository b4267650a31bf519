"""The pull scheduler: owns every replica's pull credit and assigns queued work
against it, asking the policy which queue each puller takes from and which of
its requests (by default the head, in order; pull affinity chooses).

One task does all assignment, woken by an event (a Pull, a confirmed
arrival, a requeue), or by the one timer a policy asks for when it left
work for another replica that becomes takeable later: no busy loop. Pops go through the ordered
Redis writer, so a stalled Redis pauses dispatch and nothing else. The atomic
Lua pop gives each request to exactly one replica, a named pop (the
policy's picks) too. An Assign is sent the moment its pop returns, before
anything else is done. Every placement's cache hit, and the best available,
go to the prefix metrics (router/prefix/matcher.py).

The shared queue is shared by every router on the Redis: what waits in it
is known from arrivals (this router's, and other routers' through their
kick events, events.py), not from memory. A pop takes requests this router
does not hold with their record (lazy adoption). Per-replica policies pop a
replica's own queue first, then the shared queue. A policy chooses only
among the requests this router holds; the named pop takes its picks only
while the queue's first request is one of them, then from the head.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from router.requests.record import state_from_record
from router.requests.request import Phase
from router.scheduling.credit import Credit
from router.scheduling.policies import (PENDING, Arrival, PolicySettings, make_policy,
                                        replica_queue)
from router.scheduling.policies.base import ARRIVAL, FIFO

log = logging.getLogger(__name__)


class PullScheduler:
    def __init__(self, table, store, writer, policy_name: str, lease_ttl: float, prefix,
                 settings: PolicySettings = PolicySettings(), metrics=None,
                 take_at_arrival: bool = True):
        self.table = table
        self.store = store
        self.writer = writer
        self.lease_ttl = lease_ttl
        self.prefix = prefix                # router/prefix/matcher.PrefixMatcher
        self.metrics = metrics
        self.policy = make_policy(policy_name, self, settings)
        self._credit: dict[str, Credit] = {}
        self._sessions: dict[str, object] = {}   # replica id -> its live session handle
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._pop_ids = itertools.count()
        self._pop_prefix = uuid.uuid4().hex[:12]
        self._shared_work = True   # the shared queue may hold work (cleared by a pop that empties it)
        # Arrivals stored in the shared queue without a kick to the other routers
        # (takes_arrival), numbered; those up to _kicks_covered were taken (a pop
        # sent after their submits emptied the queue) or announced (KICK).
        self._deferred = 0
        self._kicks_covered = 0
        # Replicas whose own queue may hold work this router does not hold (placed by
        # an earlier router); cleared by a pop that empties it.
        self._own_work: set[str] = set()
        self._takes_at_arrival = take_at_arrival
        # Requests taken at arrival in this turn of the loop, by replica: (session, requests).
        self._arrivals: dict[str, tuple[object, list]] = {}
        # Requests with a client's id taken at arrival whose Assign waits for their
        # submit's reply (hold_at_arrival): id -> (session, its credit, tokens spent).
        self._held: dict[str, tuple[object, Credit, int]] = {}
        self._popping = 0          # pops in flight (their seats were counted before any reply)
        # Whether this router is the only live one on its Redis (set by the router's
        # wiring from its lease renewals); until known, it is not.
        self.alone = lambda: False
        self.paused = False

    # ---- what the policy context offers ----
    def load_of(self, replica_id: str) -> int:
        return self.table.load_of(replica_id)

    def oldest(self, queue: str, n: int) -> list:
        return self.table.oldest_queued(queue, n)

    # ---- membership ----
    def attach(self, session) -> None:
        """A replica session joined (or replaced its previous session)."""
        cap = session.capacity
        limit = cap.max_num_seqs + cap.prefetch if cap.max_num_seqs else 0
        self._sessions[session.id] = session
        self._credit[session.id] = Credit(seat_limit=limit)
        self._own_work.add(session.id)
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
        self._own_work.discard(session.id)
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
    def arrival_queue(self, prompt_ids: list[int], max_tokens: int) -> str:
        return self._place(Arrival(prompt_ids, max_tokens), self.live())

    def requeue_queue(self, req, leaving: str | None) -> str:
        return self._place(req, self.live(exclude=leaving))

    def _place(self, work, live) -> str:
        target = self.policy.select(work, live)
        if target is None:
            return PENDING
        if self.prefix.recording(self.policy.uses_prefix_cache):
            self.prefix.record(work, target.id, [s.id for s in live], True)
        return replica_queue(target.id)

    def redistribute(self, queue: str) -> None:
        """Re-places the requests waiting in `queue` through the policy."""
        exclude = queue[2:] if queue.startswith("r:") else None
        for req in self.table.queued_in(queue):
            dest = self.requeue_queue(req, exclude)
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
        if self._retry is not None:
            self._retry.cancel()
        if self._task is not None:
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(self._task), self.lease_ttl)
            except asyncio.TimeoutError:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._settle_kicks(leaving=True)   # what this router deferred, the others take from here

    def kick(self) -> None:
        self._wake.set()

    def take_at_arrival(self, work, queue: str, held: bool = False) -> object | None:
        """The session that takes an arrival placed in `queue` at once, stored
        leased to it (table.admit with a replica), or None: it is queued and
        popped as usual. Only where a pop would take it at once anyway, in the
        same order: this router holds nothing queued there and knows of no work
        in it that it cannot see (other routers' included: it is the only live
        router, as its last lease renewal found), no pop is in flight, and the
        replica that would pop it has a seat: for the shared queue, the one the
        policy's Pull would choose; for a replica's own queue (a push policy's
        placement), that replica.
        An id the router made is in no other request, so its submit cannot be
        refused: its Assign goes while the submit is on the way to Redis
        (assigned_at_arrival), which saves the submit's round trip: it overlaps
        the replica's work. A client's id (held) may be taken in Redis, so its
        Assign waits for the submit's reply (hold_at_arrival, send_held): one
        round trip before the replica starts, not a submit's and then a pop's.
        A router-made id is not taken past a held one (its Assign would go
        first); a held one may follow a held one, as the replies come back,
        and are acted on, in the order the submits went.
        With another router just started and not yet seen (until this router's
        next lease renewal), a request that router stored without a kick (its
        own replicas had seats, so it pops it at once) may start a moment after
        one taken here that arrived later; nothing else can pass."""
        if (not self._takes_at_arrival or self.paused or self._popping or not self.alone()
                or self.table.waiting_in(queue) or (self._held and not held)):
            return None
        if queue != PENDING:
            owner = queue[len(replica_queue("")):]
            if owner in self._own_work:
                return None
            return next((s for s in self._pullers() if s.id == owner), None)
        if self._shared_work:
            return None
        pullers = self._pullers()
        if not pullers:
            return None
        takers = {s.id for s in pullers}
        return self.policy.take_at_arrival(work, pullers,
                                           [s for s in self.live() if s.id not in takers])

    def assigned_at_arrival(self, session, req, queue: str) -> None:
        """Sends the Assign of a request the table admitted as taken by `session`
        at arrival, from `queue` (a replica's own: its placement was recorded).
        The arrivals of one turn of the loop go in one Assign a replica, as one
        pop's do: a message each cost the router and the replica more CPU a
        request than the round trip saved, once many arrive together."""
        self._credit[session.id].spend(req.context_len)
        self._queue_arrival(session, req, queue)

    def hold_at_arrival(self, session, req) -> None:
        """A request with a client's id, taken at arrival by `session`: its seat
        is spent now, so no later arrival or pop counts on it, and its Assign
        waits for send_held (its submit stored it) or release_held."""
        credit = self._credit[session.id]
        self._held[req.id] = (session, credit, credit.spend(req.context_len))

    def send_held(self, req, queue: str) -> None:
        """Its submit stored it, leased to the session that held it: the Assign
        goes with this turn's arrivals, unless it was requeued (its replica
        left), cancelled or withdrawn meanwhile, whose seat comes back."""
        held = self._held.pop(req.id, None)
        if held is None:
            return   # released: cancelled meanwhile
        session, credit, tokens = held
        if req.phase is Phase.RUNNING and req.owner == session.id and not session.closed:
            self.table.held_assign_sent(req)
            self._queue_arrival(session, req, queue)
        else:
            credit.refund(tokens)

    def release_held(self, rid: str) -> bool:
        """A held request's Assign will never go (its submit was refused or
        timed out, or it was cancelled): its seat comes back. False: not held."""
        held = self._held.pop(rid, None)
        if held is None:
            return False
        held[1].refund(held[2])
        return True

    def _queue_arrival(self, session, req, queue: str) -> None:
        if not self._arrivals:
            asyncio.get_running_loop().call_soon(self._send_arrivals)
        self._arrivals.setdefault(session.id, (session, []))[1].append(req)
        self._record_picks(session, [req], {req.id: ARRIVAL}, placed=queue != PENDING)

    def _send_arrivals(self) -> None:
        """The Assigns of this turn's arrivals; one withdrawn meanwhile (its Cancel
        already sent), or requeued by its replica's leaving, is left out."""
        batch, self._arrivals = self._arrivals, {}
        for session, requests in batch.values():
            still = [r for r in requests if r.phase is Phase.RUNNING and r.owner == session.id]
            if still and not session.closed:
                session.send_assignments(still)

    def takes_arrival(self, queue: str) -> bool:
        """Whether an arrival in `queue` may be stored without waking the other
        routers: it goes to the shared queue and this router's replicas have a
        seat for it (and for every arrival deferred before it and not yet
        popped). Then this router pops it, no other router races it for the
        request (one that won would run it for this front, an event a delta),
        and the round that cannot take it all announces it (_settle_kicks).
        The table wakes the pop once the request may be popped (at once for an
        id this router made, after the submit's reply for a client's)."""
        if queue != PENDING or self.paused:
            return False
        if self._deferred - self._kicks_covered >= self._free_seats():
            return False
        self._deferred += 1
        return True

    def _settle_kicks(self, leaving: bool = False) -> None:
        """After a round: deferred arrivals that no pop proved taken, while the
        shared queue may hold work this router could not take (or it leaves),
        may wait there, and only this router knows: tell the others. With the
        queue thought empty, an arrival not yet announced is one whose submit
        has not been confirmed: its confirmation wakes the round that pops it.
        With a round due at once (woken meanwhile: an arrival during the last
        pop), that round pops first and settles after."""
        if self._kicks_covered < self._deferred and (
                leaving or (self._shared_work and not self._wake.is_set())):
            self._kicks_covered = self._deferred
            self.writer.post(self.store.kick())

    def probe_shared_queue(self) -> None:
        """The reaper's tick: with a replica that has seats and the shared queue
        thought empty, pop once anyway. A kick lost (its router killed between a
        deferred submit and its pop, events trimmed) then delays a request by
        one tick, not until the next arrival."""
        if not self._shared_work and not self.paused and self._pullers():
            self.work_arrived()

    def work_arrived(self) -> None:
        """Something may wait in the shared queue (an arrival, a requeue, here or
        at another router)."""
        self._shared_work = True
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
            finally:
                self._settle_kicks()

    def _free_seats(self) -> int:
        """Seats this router's replicas have granted and not filled (those that
        _pullers lists; counted on every arrival, so without its sort)."""
        total = 0
        for rid, session in self._sessions.items():
            credit, owned = self._credit[rid], self.table.owned_count(rid)
            if not session.closed and not session.draining and credit.wants_work(owned):
                total += credit.seats(owned)
        return total

    def _pullers(self) -> list:
        """Sessions with credit they can use, oldest Pull first."""
        out = []
        for rid, session in self._sessions.items():
            credit = self._credit[rid]
            if not session.closed and not session.draining and \
                    credit.wants_work(self.table.owned_count(rid)):
                out.append((credit.pulled_at, session))
        return [s for _, s in sorted(out, key=lambda x: x[0])]

    def _queue_for(self, session) -> str | None:
        own = self.policy.pull_queue(session)
        if own != PENDING and (self.table.queued_count(own) > 0 or session.id in self._own_work):
            return own
        if self._shared_work or self.table.queued_count(PENDING) > 0:
            return PENDING
        return None

    async def _round(self) -> None:
        progress = True
        while progress and not self.paused:
            progress = False
            for session in self._pullers():
                queue = self._queue_for(session)
                if queue is not None:
                    progress |= await self._serve(session, queue)

    def _pop(self, session, queue: str, credit: Credit):
        """The pop for this Pull, and why each request it may take is taken
        (None: from the head, in order)."""
        seats = credit.seats(self.table.owned_count(session.id))
        others = [s.id for s in self.live(exclude=session.id)]
        # A policy chooses among the requests this router holds; holding none
        # of this queue, it takes the head (other routers' work, in order).
        held = self.table.oldest_queued(queue, 1)
        choice = self.policy.choose(session, queue, seats, credit.token_limit, others) if held else None
        now = time.time()
        token = f"{self._pop_prefix}:{next(self._pop_ids)}"
        if choice is None:
            return self.store.pop(queue, session.id, seats, credit.token_limit,
                                  now + self.lease_ttl, now, token), None
        if choice.retry_in is not None:
            self._retry_in(choice.retry_in)
        # Sent even with no picks: the queue's first request may be another
        # router's, which this router cannot see and must not pass over.
        held = self.table.oldest_queued(queue, len(choice.picks) + 1)
        return (self.store.pop_ids(queue, session.id, seats, credit.token_limit,
                                   now + self.lease_ttl, now, token, [r.id for r in held],
                                   [r.id for r, _ in choice.picks]),
                {r.id: why for r, why in choice.picks})

    def _retry_in(self, seconds: float) -> None:
        """One timer, the earliest asked for: a round then runs with no event."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(seconds, 0.001)
        if self._retry is not None and self._retry.when() <= when:
            return
        if self._retry is not None:
            self._retry.cancel()
        self._retry = loop.call_at(when, self._retried)

    def _retried(self) -> None:
        self._retry = None
        self.kick()

    async def _serve(self, session, queue: str) -> bool:
        credit = self._credit[session.id]
        pop, reasons = self._pop(session, queue, credit)
        named = reasons is not None
        deferred_before = self._deferred   # the pop comes after these arrivals' submits
        if queue == PENDING:
            self._shared_work = False   # an arrival during the pop sets it again
        self._popping += 1
        try:
            reply = await self.writer.call(pop)
        finally:
            self._popping -= 1
        popped, left = self.store.popped(reply), self.store.left_after_pop(reply)
        if left:   # more waits (or this puller's credit ran out): the next puller pops
            if queue == PENDING:
                self._shared_work = True
        elif queue != PENDING:
            self._own_work.discard(session.id)
        elif self._kicks_covered < deferred_before:
            self._kicks_covered = deferred_before   # the queue emptied: every one was taken
        if not popped:
            if named:
                return False   # its picks went elsewhere meanwhile: proves nothing about the queue
            if queue != PENDING:
                self._own_work.discard(session.id)
                return self._shared_work   # the shared queue is next
            return False
        taken = await self._take(session, popped)
        for req in taken:
            if self._credit.get(session.id) is credit:
                credit.spend(req.context_len)
        if not taken:
            return True
        if session.closed or self._sessions.get(session.id) is not session:
            # The replica went away during the pop: it never saw this work.
            for req in taken:
                self.table.requeue(req, self.requeue_queue(req, session.id), "replica_gone")
            return True
        if self._arrivals:
            # Held arrivals whose submits went before this pop: their Assigns first.
            self._send_arrivals()
        session.send_assignments(taken)
        self._record_picks(session, taken, reasons)
        return True

    async def _take(self, session, popped) -> list:
        """The requests a pop took for this session, as this router now holds them."""
        taken, stale = [], []
        for p in popped:
            req = self.table.get(p.id)
            if req is not None and not req.confirmed and p.record is not None:
                # This router's copy is a submit still in flight for an id another
                # router stored (a client re-sending its request after its router
                # died): the pop took the stored request, and that is what runs.
                # The submit's reply (id taken) then drops the copy and attaches.
                req = None
            if req is None:
                if p.record is None:
                    log.error("popped %s, which this router should hold and does not; its "
                              "lease will lapse and it is requeued", p.id)
                    continue
                req = state_from_record(p.record)
                self.table.adopt_popped(req, session.id, p)
            elif req.phase not in (Phase.QUEUED, Phase.REMOTE):
                continue  # cancelled or withdrawn while the pop was in flight; Redis follows
            else:
                if len(req.tokens) != p.output_len:
                    stale.append(req)   # output recorded by another router that it has not seen
                self.table.assign(req, session.id, p)
            taken.append(req)
        if stale:
            try:
                records = await self.store.load_requests([r.id for r in stale])
            except Exception as exc:  # it cannot start from output it does not have
                log.warning("reading %d popped requests back failed (%s); requeued", len(stale), exc)
                for req in stale:
                    self.table.requeue(req, self.requeue_queue(req, None), "resync_failed")
                records = []
            for req, rec in zip(stale, records):
                self.table.resync(req, rec)
        limit = self.table.max_requeues
        for req in taken:
            # A router's own requeue fails a request at the limit (table.requeue);
            # the sweep of a dead router's leases (lua_routers.SWEEP_INFLIGHT)
            # counts the requeue without it, so the limit holds at the next pop.
            if req.phase is Phase.RUNNING and req.requeues > limit:
                self.table.fail(req, f"the request moved between replicas {req.requeues} times "
                                     f"(more than --max-requeues {limit}); giving up")
        return [r for r in taken if r.phase is Phase.RUNNING and r.owner == session.id]

    def _record_picks(self, session, taken, reasons: dict | None, placed: bool = False) -> None:
        """placed: the placement's cache hit was recorded at arrival (_place)."""
        if not placed and self.prefix.recording(self.policy.uses_prefix_cache):
            live = [s.id for s in self.live()]
            for req in taken:
                self.prefix.record(req, session.id, live, True)
        if self.metrics is not None:
            for req in taken:
                self.metrics.pull_pick(reasons.get(req.id, FIFO) if reasons else FIFO).inc()

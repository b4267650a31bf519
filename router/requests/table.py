"""The request table: the one owner of every request's state in the router.

Its methods are the only transitions, and each asserts what it expects:

    admit ──▶ QUEUED ──assign──▶ RUNNING ──finish / cancel──▶ FINISHED
                ▲  │move           │  ▲adopt
                │  ▼               ▼  │
              requeue ◀──────── DETACHED   (its replica's stream is gone)

    QUEUED, RUNNING, DETACHED ──run moved──▶ REMOTE ──assign──▶ RUNNING
                                (another router runs it; remote.py)

Memory changes first, synchronously, so every coroutine sees one consistent
view; the matching Redis write is queued on the ordered writer at the same
moment, so Redis always holds a prefix of this history (a restarted router
recovers from it). Nothing here awaits Redis: a stalled Redis pauses what
clients are shown (request.py) and never fails a transition.

Indexes kept here and nowhere else: requests by id, queued requests by
queue, owned requests by replica, DETACHED requests, and the outstanding
load (tokens) bound to each replica.

Several routers share Redis; a router holds a request while it is one of
its fronts (its clients' streams are here), or its back router (one of its
replicas runs it), or it waits in one of its replicas' own queues. What
changes because of another router (remote.py) changes here too, through
the same indexes.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from typing import Callable

from router.persistence.lua import STEP_HOLE, STEP_NO_RECORD
from router.persistence.store import Popped, Store, pack_logprobs, pack_tokens
from router.persistence.writer import RedisWriter
from router.requests.queue_order import QueueOrder
from router.requests.remote import CrossRouter
from router.requests.request import CANCELLED, ERROR, Phase, RequestState, Subscriber
from router.requests.spec import RequestSpec

log = logging.getLogger(__name__)
REPLICA_QUEUE_PREFIX = "r:"
SHARED_QUEUE = "pending"


def _poppable(req: RequestState) -> bool:
    return req.poppable


def full_step_fields(req: RequestState, tok_offset: int, packed: bytes, txt_offset: int,
                     text: bytes, ft: str, fs: str, finished: bool, lp_offset: int, lp: bytes,
                     ct) -> tuple:
    """lua.STEP's full form of a delta (STEP_FULL_ARGS fields); a finished one
    carries the request's finish as recorded in memory."""
    end = ((1, req.finish_reason, req.error, req.replica_id, repr(req.finished_at),
            req.preemptions) if finished else (0, "", "", "", "", ""))
    return (req.id, tok_offset, packed, txt_offset, text, ft, fs, *end, lp_offset, lp, ct,
            req.assignments)


class RequestTable(CrossRouter):
    def __init__(self, store: Store, writer: RedisWriter, metrics, *, lease_ttl: float,
                 max_requeues: int, show_output: str = "first_and_finish"):
        self.store = store
        self.writer = writer
        self.metrics = metrics
        self.lease_ttl = lease_ttl
        self.max_requeues = max_requeues
        # Which deltas of a request this router runs are shown before Redis holds
        # them (config.SHOW_OUTPUT). Safe: the replica keeps each delta until the
        # router's Ack (sent once durable), so what a client saw survives a router crash.
        self.show_output = show_output
        self.requests: dict[str, RequestState] = {}
        self._queued: dict[str, dict[str, RequestState]] = {}
        self._order: dict[str, QueueOrder] = {}   # the same requests, in queue order
        self._owned: dict[str, dict[str, RequestState]] = {}
        self._detached: dict[str, RequestState] = {}
        self._load: dict[str, int] = {}
        self._poppable: dict[str, int] = {}
        self._withdrawing: set[str] = set()
        self._attaching: dict[str, list] = {}   # ATTACH in flight: events that wait for it
        self._tokens = itertools.count()
        self._epoch = uuid.uuid4().hex[:12]   # makes submit tokens unique across router lives
        self.stopping = False                 # set at shutdown: streams end, nothing is cancelled
        # Set by the router's wiring (upper layers); called after the change is made.
        self.on_queued: Callable[[], None] = lambda: None
        self.on_cancel_running: Callable[[str, str], None] = lambda owner, rid: None
        # Its replica's deltas for it are ignored from now on (it runs elsewhere).
        self.on_release_running: Callable[[str, str], None] = lambda owner, rid: None
        self.on_reload: Callable[[str], None] = lambda rid: None   # read it again from Redis

    # ---- reads ----
    def get(self, rid: str) -> RequestState | None:
        return self.requests.get(rid)

    def queued_in(self, queue: str) -> list[RequestState]:
        """Queued requests of one queue, in queue order."""
        return sorted(self._queued.get(queue, {}).values(), key=lambda r: r.order)

    def oldest_queued(self, queue: str, n: int) -> list[RequestState]:
        """The first n poppable requests of a queue, in queue order."""
        order = self._order.get(queue)
        return order.first(n, _poppable) if order is not None else []

    def waiting_in(self, queue: str) -> int:
        """Every request queued here in `queue`, poppable or not (a client's id
        whose submit is in flight too)."""
        return len(self._queued.get(queue, ()))

    def queued_count(self, queue: str) -> int:
        """Queued requests a pop may take (RequestState.poppable): only those are
        popped, so a pop never takes a record that is not this router's own."""
        return self._poppable.get(queue, 0)

    @property
    def queued_total(self) -> int:
        # list() first: one C call, so a metrics scrape on another thread reads
        # a consistent set of queues (metrics.py).
        return sum(len(q) for q in list(self._queued.values()))

    def owned_counts(self) -> list[tuple[str, int]]:
        """(replica id, requests it owns) for every replica the table indexes."""
        return [(rid, len(owned)) for rid, owned in list(self._owned.items())]

    def owned_by(self, replica_id: str) -> list[RequestState]:
        return list(self._owned.get(replica_id, {}).values())

    def owned_count(self, replica_id: str) -> int:
        owned = self._owned.get(replica_id)
        return len(owned) if owned is not None else 0

    def load_of(self, replica_id: str) -> int:
        return self._load.get(replica_id, 0)

    def withdrawing(self, rid: str) -> bool:
        return rid in self._withdrawing

    def expired_detached(self, now: float) -> list[RequestState]:
        return [r for r in self._detached.values() if r.lease_deadline <= now]

    def running_leases(self, replica_ids, now: float) -> dict[str, float]:
        """Leases to renew. A client's id taken at arrival is left out until its
        submit is stored: that submit leases it, and if Redis refuses it the id
        is another request's, whose lease is not this router's to extend."""
        return {rid: now + self.lease_ttl for owner in replica_ids
                for rid, req in self._owned.get(owner, {}).items()
                if req.phase is Phase.RUNNING and (req.confirmed or not req.spec.request_id)}

    # ---- index upkeep (private) ----
    def _enqueue(self, req: RequestState, queue: str) -> None:
        req.phase, req.queue, req.owner = Phase.QUEUED, queue, None
        self._queued.setdefault(queue, {})[req.id] = req
        self._order.setdefault(queue, QueueOrder()).add(req)
        if req.poppable:
            self._poppable[queue] = self._poppable.get(queue, 0) + 1
        self._add_load(queue, req.cost)

    def _dequeue(self, req: RequestState) -> None:
        del self._queued[req.queue][req.id]
        self._order[req.queue].remove(req)
        if req.poppable:
            self._poppable[req.queue] -= 1
        self._add_load(req.queue, -req.cost)
        req.queue = ""

    def _own(self, req: RequestState, replica_id: str) -> None:
        req.owner = replica_id
        self._owned.setdefault(replica_id, {})[req.id] = req
        self._load[replica_id] = self._load.get(replica_id, 0) + req.cost

    def _disown(self, req: RequestState) -> None:
        owner = req.owner
        del self._owned[owner][req.id]
        self._load[owner] -= req.cost
        self._detached.pop(req.id, None)
        req.owner = None

    def _add_load(self, queue: str, cost: int) -> None:
        if queue.startswith(REPLICA_QUEUE_PREFIX):
            rid = queue[len(REPLICA_QUEUE_PREFIX):]
            self._load[rid] = self._load.get(rid, 0) + cost

    def forget_replica(self, replica_id: str) -> None:
        """A replica left for good: drop its (empty) index entries."""
        queue = REPLICA_QUEUE_PREFIX + replica_id
        if not self._owned.get(replica_id) and not self._queued.get(queue):
            self._owned.pop(replica_id, None)
            self._queued.pop(queue, None)
            self._order.pop(queue, None)
            self._poppable.pop(queue, None)
            self._load.pop(replica_id, None)

    # ---- admit ----
    def admit(self, spec: RequestSpec, prompt_ids: list[int], max_tokens: int, queue: str,
              rid: str, digest: str, tell_others: bool = True, replica: str | None = None):
        """A new request, QUEUED in memory; returns it and the future of its submit
        write, which fails with TimeoutError past the writer's reply_timeout.
        tell_others False: its submit does not wake the other routers (this
        router's scheduler takes it, or tells them itself).
        replica: taken at arrival (the scheduler's take_at_arrival): RUNNING on it
        at once, its first assignment, and stored leased to it. An id the router
        made is in no other request, so its submit cannot be refused and the
        replica may start before Redis has the record; a client's id may be
        taken, so the scheduler holds its Assign until the submit's reply (and
        forget_unstored drops it if refused). Until the submit is durable the
        client is not answered (admission.open awaits it), so nothing is shown
        of a request Redis may not hold."""
        assert rid not in self.requests, rid
        now = time.time()
        req = RequestState(spec, prompt_ids, rid=rid, digest=digest, max_tokens=max_tokens,
                           arrival=now)
        req.submit_token = f"{self._epoch}:{next(self._tokens)}"
        req.front = True
        # An id the router made is in no other request, so this submit cannot be
        # refused: a pop may take it at once, as the writer sends the pop after
        # it (pops and submits then share a round trip, the client waits one
        # less). A client's id may be taken in Redis: it waits for the reply.
        req.poppable = not spec.request_id
        self.requests[rid] = req
        lease_expiry = 0.0
        if replica is None:
            self._enqueue(req, queue)
        else:
            req.phase, req.queue = Phase.RUNNING, ""
            self._own(req, replica)
            req.assignments, req.requeues, req.preemption_base = 1, 0, 0
            if not spec.request_id:   # a client's id: its Assign waits (held_assign_sent)
                req.assigned_at = now
                self.metrics.queue_wait.observe(0.0)
            lease_expiry = now + self.lease_ttl
        spec_json = spec.sampling.set_fields_json
        future = self.writer.call_timed(self.store.submit(
            rid, req.submit_token, digest, spec_json, prompt_ids, max_tokens, spec.priority, now,
            spec.stream_interval, queue, tell_others, replica or "", lease_expiry))
        if req.poppable and replica is None:
            self.on_queued()
        return req, future

    def stored_queued_ids(self) -> list[str]:
        """Requests queued here whose submit Redis acknowledged."""
        return [r.id for r in self.requests.values() if r.phase is Phase.QUEUED and r.confirmed]

    def resubmit_lost(self, ids: list[str]) -> None:
        """Redis lost these queued requests' submits (acknowledged writes dropped
        by a restart or failover): each is stored again as it was, with its own
        token and arrival, so its place in the queue and a retry's re-attach hold."""
        lost = [self.requests[i] for i in ids if i in self.requests
                and self.requests[i].phase is Phase.QUEUED]
        if not lost:
            return
        log.warning("Redis lost %d queued request(s) it had stored: storing them again", len(lost))
        self.metrics.lost_writes.labels("submit").inc(len(lost))
        for req in lost:
            spec = req.spec
            self.writer.post(self.store.submit(
                req.id, req.submit_token, req.digest, spec.sampling.set_fields_json, req.prompt_ids,
                req.max_tokens, spec.priority, req.arrival, spec.stream_interval, req.queue))
        self.on_queued()

    def confirm(self, req: RequestState) -> None:
        """Its submit is durable: it may be popped, if it was not already."""
        assert not req.confirmed, req.id
        req.confirmed = True
        req.accepted_at = time.time()
        self.metrics.accepted.inc()
        self.metrics.prompt_tokens.inc(req.prompt_len)
        if req.poppable:
            return
        req.poppable = True
        if req.phase is Phase.QUEUED:   # not one taken at arrival, or ended meanwhile
            self._poppable[req.queue] = self._poppable.get(req.queue, 0) + 1
            self.on_queued()

    def held_assign_sent(self, req: RequestState) -> None:
        """The held Assign of a client's id taken at arrival goes now (the
        scheduler's send_held): its queue wait was its submit's round trip."""
        req.assigned_at = time.time()
        self.metrics.queue_wait.observe(req.assigned_at - req.arrival)

    def forget_unstored(self, req: RequestState) -> None:
        """Its submit found the id taken in Redis: this copy never existed.
        Queued, or running on the replica that took it at arrival (its Assign
        held back for this reply, so that replica never heard of it), or
        already ended here (cancelled while its submit was on the way)."""
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
        elif req.owner is not None:
            self._disown(req)
        req.phase = Phase.FINISHED
        if self.requests.get(req.id) is req:
            del self.requests[req.id]

    def withdraw(self, req: RequestState) -> None:
        """Its submit did not become durable in time (the client was told
        UNAVAILABLE): removed here, and from Redis once the submit has landed,
        so a retry with the same id starts afresh."""
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
        elif req.owner is not None:
            self.on_cancel_running(req.owner, req.id)
            self._disown(req)
        req.phase = Phase.FINISHED
        self._withdrawing.add(req.id)

        def withdrawn(_reply) -> None:
            self._withdrawing.discard(req.id)
            if self.requests.get(req.id) is req:
                del self.requests[req.id]

        self.writer.post(self.store.abandon(req.id, req.submit_token)).on_done = withdrawn

    # ---- assignment ----
    def assign(self, req: RequestState, replica_id: str, popped: Popped) -> None:
        """A pop took it for this replica (Redis already says so, with this
        assignment count, which every later write for it names)."""
        assert req.phase in (Phase.QUEUED, Phase.REMOTE), (req.id, req.phase)
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
        req.phase = Phase.RUNNING
        self._own(req, replica_id)
        req.assignments, req.requeues = popped.assignments, popped.requeues
        req.preemption_base = req.preemptions
        first = not req.assigned_at
        req.assigned_at = time.time()
        if first:
            self.metrics.queue_wait.observe(req.assigned_at - req.arrival)

    def move(self, req: RequestState, queue: str) -> None:
        assert req.phase is Phase.QUEUED, (req.id, req.phase)
        if req.queue == queue:
            return
        source = req.queue
        self._dequeue(req)
        self._enqueue(req, queue)
        self.writer.post(self.store.move([req.id, source, queue]))
        self.on_queued()

    def requeue(self, req: RequestState, queue: str, reason: str) -> None:
        """Back to the front of a queue, keeping its output (it resumes elsewhere)."""
        assert req.phase in (Phase.RUNNING, Phase.DETACHED), (req.id, req.phase)
        owner = req.owner
        if req.requeues >= self.max_requeues:
            self._disown(req)
            self._finish(req, ERROR, f"the request moved between replicas {req.requeues} times "
                                     f"(last: {reason}); giving up", "")
            self._write_finish(req)
            return
        self._disown(req)
        req.requeues += 1
        self._enqueue(req, queue)
        self.metrics.requeues.labels(reason).inc()
        self.writer.post(self.store.requeue([req.id, queue, owner, req.assignments, req.requeues]))
        if queue == SHARED_QUEUE and not req.front and not req.subscribers:
            # Another router is its front: whoever pops it next takes it in from Redis.
            self._dequeue(req)
            req.phase = Phase.REMOTE
            self._forget(req)
        self.on_queued()

    def detach(self, req: RequestState, deadline: float) -> None:
        """Its replica's stream went away: it keeps the work until the lease lapses."""
        assert req.phase is Phase.RUNNING, (req.id, req.phase)
        req.phase = Phase.DETACHED
        req.lease_deadline = deadline
        self._detached[req.id] = req

    def adopt(self, req: RequestState, replica_id: str) -> None:
        """The owning replica re-registered holding it: it runs on, nothing is recomputed."""
        assert req.phase in (Phase.RUNNING, Phase.DETACHED) and req.owner == replica_id, req.id
        req.phase = Phase.RUNNING
        self._detached.pop(req.id, None)

    # ---- output ----
    def record_step(self, items, replica_id: str, on_durable: Callable[[], None]) -> None:
        """Applies validated deltas [(request, delta)] of one StepOutputs; on_durable
        runs once Redis holds them (the replica may then forget them). A delta
        Redis drops (the request moved on meanwhile: requeued, adopted elsewhere,
        cancelled by another router) is taken back (remote.py: step_dropped)."""
        now = time.time()
        deltas: list = []
        marks = []
        for req, d in items:
            assert req.phase is Phase.RUNNING and req.owner == replica_id, (req.id, req.phase)
            before = (len(req.tokens), len(req.parts), len(req.logprobs), req.text_bytes)
            deltas.append(self._step_item(req, d, replica_id, now))
            marks.append((req, len(req.tokens), len(req.parts), req.finished, before))
        mode, stalled = self.show_output, self.writer.stalled
        if mode != "once_durable" or stalled:
            # first_and_finish: what would wait a Redis round trip on top of TTFT or
            # end-to-end latency is shown at once; deltas in between wait, which
            # batches them into fewer client messages when steps come faster
            # than Redis answers (fewer than on_arrival sends).
            every = stalled or mode == "on_arrival"
            for req, n_tok, n_parts, finished, before in marks:
                if every or finished or (n_tok and not before[0]):
                    self._show(req, n_tok, n_parts, finished)

        def durable(reply) -> None:
            written = reply if isinstance(reply, list) else [1] * len(marks)
            holes, lost = [], []
            for mark, ok in zip(marks, written):
                req, n_tok, n_parts, finished, before = mark
                ok = int(ok)
                if ok == STEP_HOLE:
                    holes.append(mark)
                elif ok == STEP_NO_RECORD and self._restorable(req, replica_id, finished):
                    lost.append(mark)
                elif ok != 1:
                    self.step_dropped(req, before, finished)
                else:
                    self._written(req, n_tok, n_parts, finished)
            if holes or lost:
                self._rewrite_output(holes, lost, replica_id, on_durable)
            else:
                on_durable()

        write = self.store.step(deltas) if deltas else self.store.barrier(None)
        write.on_done = durable
        self.writer.post(write)

    def _written(self, req: RequestState, n_tok: int, n_parts: int, finished: bool) -> None:
        self._show(req, n_tok, n_parts, finished)
        if finished:
            self._forget_finished(req)

    def _restorable(self, req: RequestState, replica_id: str, finished: bool) -> bool:
        """Whether this router may store again the record of a request Redis has
        none of: one it still holds that ran here on this replica (or finished
        with this delta), whether it fronts it or runs it for another router's
        client; not one it withdrew or that ended here otherwise meanwhile
        (cancelled, failed). One another router removed on purpose (lua.ABANDON)
        is refused by RESTORE itself, by its tombstone."""
        if self.requests.get(req.id) is not req or req.id in self._withdrawing:
            return False
        return finished or (req.phase in (Phase.RUNNING, Phase.DETACHED)
                            and req.owner == replica_id and not req.finished)

    def _restored(self, reply) -> None:
        """RESTORE's answer: counted and logged only where the record was lost,
        not where another router removed it on purpose (lua.ABANDON)."""
        if int(reply[0]) == 1:
            log.warning("Redis lost the record of a running request (a restart or failover that "
                        "dropped acknowledged writes): stored it again from memory")
            self.metrics.lost_writes.labels("record").inc()

    def _rewrite_output(self, holes: list, lost: list, replica_id: str,
                        on_durable: Callable[[], None]) -> None:
        """Redis lost writes it had acknowledged (a restart from an AOF fsynced
        once a second, a failover to a lagging replica): lua.STEP found a hole in
        a request's output (holes) or no record of it at all (lost). A lost
        record is stored again from memory (lua.RESTORE); then each request's
        output up to the refused delta is written again whole, from memory, in
        the full form (a record RESTORE refused as abandoned stays gone, and that
        delta is dropped). The replica's Ack waits for it."""
        if holes:
            log.warning("Redis lost recorded output of %d request(s) (a restart or failover "
                        "that dropped acknowledged writes): writing it again from memory",
                        len(holes))
            self.metrics.lost_writes.labels("output").inc(len(holes))
        expiry = time.time() + self.lease_ttl
        for req, *_ in lost:
            spec = req.spec
            self.writer.post(self.store.restore(
                req.id, req.submit_token, req.digest, spec.sampling.set_fields_json,
                req.prompt_ids, req.max_tokens, spec.priority, req.arrival,
                spec.stream_interval, replica_id, req.assignments, req.requeues, expiry,
                front=req.front)).on_done = self._restored
        marks = holes + lost

        def durable(reply) -> None:
            for (req, n_tok, n_parts, finished, before), ok in zip(marks, reply):
                if int(ok) == 1:
                    self._written(req, n_tok, n_parts, finished)
                else:
                    self.step_dropped(req, before, finished)
            on_durable()

        items = [self._whole_output_item(req, n_tok, n_parts, finished)
                 for req, n_tok, n_parts, finished, _ in marks]
        self.writer.post(self.store.step(items)).on_done = durable

    @staticmethod
    def _whole_output_item(req: RequestState, n_tok: int, n_parts: int, finished: bool) -> tuple:
        """lua.STEP's full form of a request's output up to n_tok tokens and
        n_parts text parts, from offset 0, with its finish when finished."""
        k = req.logprobs_k
        lp = pack_logprobs(req.logprobs[:n_tok], k) if k is not None and n_tok else b""
        text = "".join(req.parts[:n_parts]).encode()
        ft = repr(req.first_token_at) if req.first_token_at else ""
        fs = repr(req.first_scheduled_at) if req.first_scheduled_at else ""
        return full_step_fields(req, 0, pack_tokens(req.tokens[:n_tok]), 0, text, ft, fs, finished,
                                0, lp, req.cached_tokens or "")

    def _step_item(self, req: RequestState, d, replica_id: str, now: float) -> tuple:
        """One delta into memory; returns its lua.STEP fields, in the plain form
        when it carries output only."""
        metrics = self.metrics
        tokens = d.token_ids
        tok_offset, txt_offset = 4 * len(req.tokens), req.text_bytes
        ft = fs = ""
        if tokens:
            if req.first_token_at:   # per token: a coalesced delta carries several
                metrics.tbt.observe((now - req.last_token_at) / len(tokens))
            else:
                metrics.ttft.observe(now - req.arrival)
                req.first_token_at = now
                ft = repr(now)
            req.tokens.extend(tokens)
            req.last_token_at = now
            metrics.generation_tokens.inc(len(tokens))
        text = d.text.encode() if d.text else b""
        if text:
            req.parts.append(d.text)
            req.text_bytes += len(text)
        if d.first_scheduled_at and not req.first_scheduled_at:
            req.first_scheduled_at = d.first_scheduled_at
            fs = repr(d.first_scheduled_at)
        if d.preemptions:
            req.preemptions = req.preemption_base + d.preemptions
        packed = pack_tokens(tokens) if tokens else b""
        lp_offset, lp = self._record_logprobs(req, d)
        ct = ""
        if d.cached_tokens and not req.cached_tokens:
            req.cached_tokens = ct = d.cached_tokens
        if d.HasField("finish_reason"):
            req.replica_id = replica_id
            self._disown(req)
            self._finish(req, d.finish_reason, d.error, "")
            return full_step_fields(req, tok_offset, packed, txt_offset, text, ft, fs, True,
                                    lp_offset, lp, ct)
        if not (ft or fs or lp or ct):
            return (req.id, tok_offset, packed, txt_offset, text, req.assignments)
        return full_step_fields(req, tok_offset, packed, txt_offset, text, ft, fs, False,
                                lp_offset, lp, ct)

    @staticmethod
    def _record_logprobs(req: RequestState, d) -> tuple[int, bytes]:
        """Appends a delta's logprobs; returns their byte offset and packing (lp key)."""
        k = req.logprobs_k
        if k is None or not d.token_ids:
            return 0, b""
        offset = len(req.logprobs)
        entries = [(e.logprob, tuple(zip(e.top_token_ids, e.top_logprobs))) for e in d.logprobs]
        entries += [(0.0, ())] * (len(d.token_ids) - len(entries))  # a replica that sent none
        req.logprobs.extend(entries)
        return offset * (4 + 8 * k), pack_logprobs(entries, k)

    def _show(self, req: RequestState, n_tok: int, n_parts: int, finished: bool) -> None:
        req.visible_tokens = max(req.visible_tokens, n_tok)
        req.visible_parts = max(req.visible_parts, n_parts)
        req.finish_visible = req.finish_visible or finished
        req.notify()

    def on_stall(self, stalled: bool) -> None:
        """Redis is slow: show clients what arrived (see request.py)."""
        if stalled:
            for req in self.requests.values():
                self._show(req, len(req.tokens), len(req.parts), req.finished)

    # ---- endings ----
    def _finish(self, req: RequestState, reason: int, error: str, _source: str) -> None:
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
        now = time.time()
        req.phase = Phase.FINISHED
        req.finish_reason, req.error, req.finished_at = reason, error, now
        self.metrics.finished_with(reason).inc()
        self.metrics.e2e.observe(now - req.arrival)

    def _forget_finished(self, req: RequestState) -> None:
        self._forget(req)

    def _forget(self, req: RequestState) -> None:
        if self.requests.get(req.id) is req:
            del self.requests[req.id]

    def _write_finish(self, req: RequestState) -> None:
        fields = {"fr": req.finish_reason, "err": req.error, "rep": req.replica_id,
                  "fin": repr(req.finished_at), "pre": req.preemptions}
        if self.writer.stalled:   # not on arrival: no replica holds a finish the router made
            self._show(req, len(req.tokens), len(req.parts), True)

        def durable(_reply) -> None:
            self._show(req, len(req.tokens), len(req.parts), True)
            self._forget_finished(req)

        self.writer.post(self.store.finish(req.id, fields)).on_done = durable

    def fail(self, req: RequestState, error: str) -> None:
        """Ends a live request with FINISH_REASON_ERROR (what the client is told: error)."""
        assert req.live, req.id
        if req.owner is not None:
            self.on_cancel_running(req.owner, req.id)
            self._disown(req)
        self._finish(req, ERROR, error, "")
        self._write_finish(req)

    def cancel(self, rid: str, source: str) -> bool:
        req = self.requests.get(rid)
        if req is None or not req.live:
            return False
        if req.owner is not None:
            self.on_cancel_running(req.owner, rid)
            self._disown(req)
        self._finish(req, CANCELLED, "", source)
        self.metrics.cancellations.labels(source).inc()
        self._write_finish(req)
        return True

    # ---- client streams ----
    def subscribe(self, req: RequestState, interval: int, event=None) -> Subscriber:
        if req.live and not req.front:
            # Run here for another router's client: this one becomes a front too,
            # so what other routers record for it later reaches this stream.
            req.front = True
            self.writer.post(self.store.attach(req.id, req.digest))
        return req.subscribe(interval, event)

    def unsubscribe(self, req: RequestState, sub: Subscriber) -> None:
        """The last stream of an unfinished request going away cancels it,
        unless the router itself is ending the streams (shutdown)."""
        req.unsubscribe(sub)
        if req.live and not req.subscribers and not self.stopping and not sub.detached:
            self.cancel(req.id, "disconnect")

    def detach_clients(self, reason: str) -> None:
        """Shutdown: ends every client stream with `reason`, cancelling nothing."""
        self.stopping = True
        for req in self.requests.values():
            for sub in req.subscribers:
                sub.detached = reason
                sub.event.set()


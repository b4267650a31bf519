"""Request state transitions: accept, queue, assign, finish, cancel, requeue.

Invariants:
- In memory, a live request is QUEUED (counted in queued_counts[its queue]) or
  RUNNING (in its owner's `owned`); memory changes first, synchronously, then
  Redis follows in one round trip, so concurrent coroutines see a consistent
  view. Unfinished = queued + in flight.
- A request's Redis record is what a restarted router recovers from.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.pb.quadriga.v1 import generation_pb2 as gpb
from common.pb.quadriga.v1 import replica_pb2 as rpb
from common.tokenizer import load_tokenizer
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.metrics import Metrics
from router.policies import PENDING, make_policy, replica_queue
from router.registry import Registry, ReplicaSession
from router.requests import Phase, RequestState
from router.store import Store
from router.validation import (ModelLimits, RouterError, check_request, digest,
                               effective_max_tokens)

log = logging.getLogger(__name__)
CANCELLED = gpb.FINISH_REASON_CANCELLED


class RouterCore:
    def __init__(self, config: RouterConfig, limits: ModelLimits, metrics: Metrics):
        self.config = config
        self.limits = limits
        self.metrics = metrics
        self.store = Store(config.redis_url, config.redis_prefix, config.result_ttl)
        self.registry = Registry()
        self.policy = make_policy(config.policy)
        self.dispatcher = Dispatcher(self)
        self.requests: dict[str, RequestState] = {}
        self.queued_counts: dict[str, int] = {}
        self.orphans: dict[str, tuple[str, float]] = {}   # id -> (recorded owner, deadline)
        # Requests whose Redis record fell behind memory when a Redis call failed:
        # id -> (request, whether its output must be rewritten). The reaper
        # rewrites them (resync); until then they are not requeued in Redis.
        self.dirty: dict[str, tuple[RequestState, bool]] = {}
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self._tokenizer = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tokenizer = await loop.run_in_executor(self.executor, load_tokenizer, self.config.model)
        await self.store.ping()
        self.dispatcher.start()

    async def stop(self) -> None:
        await self.dispatcher.stop()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.store.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @property
    def queued_total(self) -> int:
        return sum(self.queued_counts.values())

    # ---- local bookkeeping (synchronous) ----
    def enqueue_local(self, req: RequestState, queue: str) -> None:
        req.phase, req.queue, req.owner = Phase.QUEUED, queue, None
        self.queued_counts[queue] = self.queued_counts.get(queue, 0) + 1
        self._hold_load(req, None if queue == PENDING else self.registry.get(queue[2:]))
        self.metrics.queue_depth.inc()

    def _dequeue_local(self, req: RequestState) -> None:
        self.queued_counts[req.queue] -= 1
        req.queue = ""
        self.metrics.queue_depth.dec()

    def _hold_load(self, req: RequestState, session: ReplicaSession | None) -> None:
        if req.load_holder is session:
            return
        self._release_load(req)
        if session is not None:
            session.load_tokens += req.cost
            req.load_holder = session

    def _release_load(self, req: RequestState) -> None:
        if req.load_holder is not None:
            req.load_holder.load_tokens -= req.cost
            req.load_holder = None

    def assign_local(self, req: RequestState, session: ReplicaSession) -> None:
        self._dequeue_local(req)
        self._hold_load(req, session)
        req.phase, req.owner = Phase.RUNNING, session
        req.preemption_base = req.preemptions
        req.assigned_at = time.time()
        session.owned[req.id] = req
        self.metrics.queue_wait.observe(req.assigned_at - req.arrival)
        self.metrics.inflight_of(session.id).inc()
        self.policy.on_assigned(req, session)

    def finish_local(self, req: RequestState, reason: int, error: str = "") -> None:
        if req.phase is Phase.QUEUED:
            self._dequeue_local(req)
        owner = req.owner
        if owner is not None:
            owner.owned.pop(req.id, None)
            self.metrics.inflight_of(owner.id).dec()
        self._release_load(req)
        self.orphans.pop(req.id, None)
        if self.requests.get(req.id) is req:
            del self.requests[req.id]
        now = time.time()
        req.finish(reason, error, now)
        self.metrics.finished_with(reason).inc()
        self.metrics.e2e.observe(now - req.arrival)
        self.policy.on_finished(req)

    def finish_fields(self, req: RequestState) -> dict:
        return {"fr": req.finish_reason, "err": req.error, "rep": req.replica_id,
                "fin": repr(req.finished_at), "ft": repr(req.first_token_at),
                "fs": repr(req.first_scheduled_at), "pre": req.preemptions,
                "asg": repr(req.assigned_at)}

    # ---- client side ----
    async def open(self, request: gpb.GenerateRequest) -> RequestState:
        """Validates and accepts a request, or finds the one it re-attaches to."""
        check_request(request, self.limits)
        body_digest = digest(request)
        if request.request_id and request.request_id in self.requests:
            return self._reattach(self.requests[request.request_id], body_digest)
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
        else:
            ids = await self._tokenize(request.prompt)
        max_tokens = effective_max_tokens(request, len(ids), self.limits)
        return await self._submit(request, ids, max_tokens, body_digest)

    async def _tokenize(self, prompt: str) -> list[int]:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, self._tokenizer.encode, prompt)
        except Exception as exc:  # a tokenizer failure is answered, never swallowed
            raise RouterError(grpc.StatusCode.INTERNAL, f"tokenizing the prompt failed: {exc}",
                              "tokenizer") from exc

    def _reattach(self, req: RequestState, body_digest: str) -> RequestState:
        if req.digest != body_digest:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id {req.id!r} is in use by a different request (prompt, "
                              "sampling or priority differ); re-attaching needs the identical "
                              "request, otherwise choose a new request_id", "duplicate_id")
        return req

    async def _submit(self, request, ids, max_tokens, body_digest) -> RequestState:
        if self.queued_total >= self.config.queue_limit:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"queue is full ({self.config.queue_limit} requests waiting); "
                              "retry later", "queue_full")
        await self._wait_for_replica()
        rid = request.request_id or uuid.uuid4().hex
        if rid in self.requests:  # the same id arrived while we waited
            return self._reattach(self.requests[rid], body_digest)
        assignment = rpb.Assignment(request_id=rid, prompt_token_ids=ids,
                                    sampling=request.sampling, arrival_time=time.time())
        # Explicit, so the replica and the router agree on when the request ends.
        assignment.sampling.max_tokens = max_tokens
        req = RequestState(assignment, digest=body_digest, max_tokens=max_tokens,
                           priority=request.priority, stream_interval=request.stream_interval)
        target = self.policy.select(req, self.registry.live())
        queue = replica_queue(target.id) if target else PENDING
        # Queued in memory before the script runs: a concurrent pop may take it
        # as soon as Redis has it.
        self.requests[rid] = req
        self.enqueue_local(req, queue)
        try:
            created, member, state = await self.store.submit(
                rid, body_digest, assignment.SerializeToString(), len(ids), max_tokens,
                request.priority, assignment.arrival_time, request.stream_interval, queue)
        except Exception as exc:
            self._forget_unstored(req)
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"the router could not store the request (Redis: {exc}); retry",
                              "store") from exc
        except BaseException:
            self._forget_unstored(req)
            raise
        if not created:
            self._forget_unstored(req)
            return await self._reattach_stored(rid, body_digest, member)
        req.member = member
        self.metrics.accepted.inc()
        self.policy.on_request_arrival(req)
        if req.phase is Phase.QUEUED and self._placement_stale(req.queue):
            # Its replica left (or drained) while the script ran: that queue was
            # redistributed without it (it had no member yet), so re-place it now.
            await self.redistribute(req.queue)
        self.dispatcher.kick()
        return req

    def _placement_stale(self, queue: str) -> bool:
        """A per-replica policy's request waits where no replica will pull it."""
        if not self.policy.per_replica_queues:
            return False
        if queue == PENDING:
            return bool(self.registry.live())
        session = self.registry.get(queue[2:])
        return session is None or session.closed or session.draining

    def _forget_unstored(self, req: RequestState) -> None:
        if req.phase is Phase.QUEUED:
            self._dequeue_local(req)
            self._release_load(req)
        if self.requests.get(req.id) is req:
            del self.requests[req.id]

    async def _wait_for_replica(self) -> None:
        if len(self.registry):
            return
        try:
            await asyncio.wait_for(self.registry.any_replica.wait(), self.config.no_replica_timeout)
        except asyncio.TimeoutError:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"no replica serving {self.config.served_model_name} connected within "
                              f"{self.config.no_replica_timeout:g} s", "no_replica") from None

    async def _reattach_stored(self, rid: str, body_digest: str, stored_digest: str) -> RequestState:
        """The id exists in Redis but not in memory: a finished request kept for result_ttl."""
        if stored_digest != body_digest:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"request_id {rid!r} was used by a different request", "duplicate_id")
        from router.recovery import state_from_record
        [rec] = await self.store.load_requests([rid])
        if rec is None:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"request {rid!r} expired while re-attaching; retry", "expired")
        req = state_from_record(rec)
        if not req.finished:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"request {rid!r} is being recovered; retry", "recovering")
        return req

    async def cancel(self, rid: str, source: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        owner = req.owner
        if owner is not None:
            owner.remember_released(rid)
            owner.send(rpb.RouterMessage(cancel=rpb.CancelRequests(request_ids=[rid])))
        was_queued = req.phase is Phase.QUEUED
        self.finish_local(req, CANCELLED)
        self.metrics.cancellations.labels(source).inc()
        try:
            if was_queued and await self.store.cancel_queued(rid, req.finished_at, CANCELLED, ""):
                pass
            else:  # running, or popped concurrently: record the final state
                pipe = self.store.pipeline()
                self.store.add_finish(pipe, rid, self.finish_fields(req))
                await self.store.execute(pipe)
        except Exception as exc:
            self.mark_dirty([req], exc)  # recorded by the reaper once Redis answers
        finally:
            req.notify()
        return True

    async def discard_popped(self, ids: list[str]) -> None:
        """Popped ids whose request was cancelled meanwhile: close their records."""
        pipe = self.store.pipeline()
        for rid in ids:
            self.store.add_finish(pipe, rid, {"fr": CANCELLED})
        await self.store.execute(pipe)

    # ---- moving work between queues ----
    async def requeue_owned(self, session: ReplicaSession, reqs: list[RequestState],
                            reason: str) -> None:
        """Back to the front of a queue, keeping the output so far (resumed elsewhere)."""
        items = []
        live = [s for s in self.registry.live() if s is not session]
        for req in reqs:
            if req.owner is not session or req.finished:
                continue
            session.owned.pop(req.id, None)
            self.metrics.inflight_of(session.id).dec()
            self._release_load(req)
            target = self.policy.select(req, live)
            queue = replica_queue(target.id) if target else PENDING
            req.requeues += 1
            self.enqueue_local(req, queue)
            items.append((req.id, queue))
            self.metrics.requeues.labels(reason).inc()
        await self._requeue_in_store(items, session.id)

    async def _requeue_in_store(self, items, owner: str) -> None:
        if not items:
            return
        clean = [(rid, q) for rid, q in items if rid not in self.dirty]
        try:
            await self.store.requeue(clean, owner=owner)
        except Exception as exc:
            self.mark_dirty([self.requests[rid] for rid, _ in items if rid in self.requests], exc)
        self.dispatcher.kick()

    def mark_dirty(self, reqs, exc: BaseException | None, output: bool = False) -> None:
        """Memory moved on but Redis did not follow: rewrite these from memory."""
        if exc is not None:
            log.warning("Redis call failed (%s); %d requests will be rewritten", exc, len(reqs))
        for req in reqs:
            prev = self.dirty.get(req.id)
            self.dirty[req.id] = (req, output or (prev is not None and prev[1]))

    async def resync(self) -> None:
        """Writes the dirty requests' state from memory (reaper tick)."""
        if not self.dirty:
            return
        batch, self.dirty = self.dirty, {}
        items, seen = [], {}
        for rid, (req, output) in batch.items():
            fields = {"rq": req.requeues}
            if req.finished:
                state, queue, owner = "f", "", ""
                fields.update(self.finish_fields(req))
            elif req.phase is Phase.QUEUED:
                state, queue, owner = "q", req.queue, ""
            elif req.owner is not None:
                state, queue, owner = "r", "", req.owner.id
            else:
                continue  # a recovered orphan: its record is already right
            seen[rid] = (req.phase, req.queue, req.owner)
            items.append((rid, state, queue, owner, list(req.tokens) if output else None,
                          "".join(req.parts) if output else "", fields))
        try:
            await self.store.sync(items, time.time() + self.config.lease_ttl)
        except BaseException:
            for rid, entry in batch.items():
                self.dirty.setdefault(rid, entry)
            raise
        for rid, (req, output) in batch.items():
            if rid in seen and seen[rid] != (req.phase, req.queue, req.owner):
                self.dirty.setdefault(rid, (req, output))  # moved again meanwhile
            req.notify()
        self.dispatcher.kick()

    async def requeue_orphans(self, rids: list[str], reason: str = "lease_expired") -> None:
        """Recovered in-flight requests whose owner did not come back in time."""
        items = []
        live = self.registry.live()
        for rid in rids:
            self.orphans.pop(rid, None)
            req = self.requests.get(rid)
            if req is None or req.phase is not Phase.RUNNING or req.owner is not None:
                continue
            target = self.policy.select(req, live)
            queue = replica_queue(target.id) if target else PENDING
            req.requeues += 1
            self.enqueue_local(req, queue)
            items.append((rid, queue))
            self.metrics.requeues.labels(reason).inc()
        await self._requeue_in_store(items, "")

    async def redistribute(self, queue: str, exclude: ReplicaSession | None = None) -> None:
        """Re-places the requests waiting in `queue` through the policy."""
        waiting = sorted((r for r in self.requests.values()
                          if r.phase is Phase.QUEUED and r.queue == queue and r.member),
                         key=lambda r: r.member)
        live = [s for s in self.registry.live() if s is not exclude]
        items = []
        for req in waiting:
            target = self.policy.select(req, live)
            dest = replica_queue(target.id) if target else PENDING
            if dest == queue:
                continue
            self._dequeue_local(req)
            self.enqueue_local(req, dest)
            items.append((req.id, dest))
        try:
            await self.store.move([(rid, q) for rid, q in items if rid not in self.dirty])
        except Exception as exc:
            self.mark_dirty([self.requests[rid] for rid, _ in items if rid in self.requests], exc)
        self.dispatcher.kick()

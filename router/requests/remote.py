"""What other routers change about a request this router holds, as
transitions of the request table (mixed into RequestTable: the same maps,
the same owner). Each comes from Redis, so it is durable when it arrives:
  - a pop of a request this router does not hold (lazy adoption), a replica
    registering with requests another router ran (take_over), a client
    re-attaching here (attach_remote);
  - events (events.py): another router took its run side ('a', 'm': run_moved),
    recorded its output (remote_output), or a front cancelled it (cancelled_elsewhere);
  - a step Redis dropped because the request moved on (step_dropped).
A router keeps a request while it is a front, its back router, or holds it in
one of its replicas' queues; past that it forgets it (Redis still has it).
"""

from __future__ import annotations

import time

from router.persistence.store import record_from_flat
from router.requests.record import (RecordedDelta, finish_from_record, merge_output,
                                    state_from_record, take_output, take_timings)
from router.requests.request import CANCELLED, Phase, RequestState


class CrossRouter:
    # ---- taking requests in ----
    def adopt_popped(self, req: RequestState, replica_id: str, popped) -> None:
        """This router's pop took a request it did not hold (its record came with it).
        A copy here whose submit is still in flight gives way: its reply finds the id
        taken and forgets that copy (forget_unstored), not this one."""
        held = self.requests.get(req.id)
        assert held is None or not held.confirmed, req.id
        self.requests[req.id] = req
        req.phase = Phase.REMOTE
        self.assign(req, replica_id, popped)

    def take_over(self, rec: dict, replica_id: str) -> RequestState | None:
        """A replica registered here holding it, and Redis made this router its
        back router (lua_routers.ADOPT): it runs on, nothing recomputed."""
        req = self.requests.get(rec["id"])
        if req is None:
            req = state_from_record(rec)
            self.requests[req.id] = req
        elif req.finished:
            return None   # cancelled here meanwhile; its finish follows in Redis
        else:
            if req.phase is Phase.QUEUED:
                self._dequeue(req)
            elif req.owner is not None:
                self._disown(req)
            take_output(req, rec)
            take_timings(req, rec)
            req.assignments = int(rec.get("n", b"0") or 0)
        req.phase = Phase.RUNNING
        req.preemption_base = req.preemptions
        self._own(req, replica_id)
        return req

    def resync(self, req: RequestState, rec: dict | None) -> None:
        """Popped here while Redis holds more of its output than this router had
        seen (another router recorded it): it starts from Redis's."""
        if rec is not None:
            take_output(req, rec)
            take_timings(req, rec)

    def begin_attach(self, rid: str) -> None:
        """Events for `rid` that arrive before its ATTACH reply wait for it."""
        self._attaching.setdefault(rid, [])

    def attach_remote(self, rid: str, req: RequestState | None) -> None:
        """The ATTACH reply: a client re-attached here to a request this router
        did not hold (None: finished or gone, nothing to hold)."""
        waiting = self._attaching.pop(rid, [])
        if req is None or req.finished or rid in self.requests:
            return
        self.requests[rid] = req
        req.front = True
        req.phase = Phase.REMOTE
        for delta in waiting:
            self.remote_output(delta)

    def read_back_silent(self, now: float, silence: float) -> None:
        """REMOTE requests this router fronts that had no news for `silence`
        seconds (monotonic `now`) are read back from Redis: their events may be
        lost, their record may be gone (Redis lost it with no router running
        it to store it again), or it may no longer name this router a front
        (Redis lost it and the router running it stored it again, lua.RESTORE,
        naming at most itself). So the read is an ATTACH, which reads the record
        and makes this router a front in one step: the deltas after it reach
        this router again. Each is read at most once a `silence`; a record gone
        fails it with a message (refresh), one that moved on is taken in as any
        reload."""
        for req in self.requests.values():
            if req.phase is not Phase.REMOTE or not (req.front or req.subscribers):
                continue
            if not req.heard_at:
                req.heard_at = now
            elif now - req.heard_at >= silence:
                req.heard_at = now
                self._read_back_as_front(req)

    def _read_back_as_front(self, req: RequestState) -> None:
        rid = req.id
        req.front = True
        self.writer.post(self.store.attach(rid, req.digest)).on_done = (
            lambda flat: self.refresh(rid, record_from_flat(rid, flat)))

    # ---- events ----
    def run_moved(self, rid: str, assignments: int) -> None:
        """Another router took its run side: popped it ('a') or adopted it with
        its replica ('m'). Older news (a smaller assignment count) is ignored."""
        req = self.requests.get(rid)
        if req is None or req.finished or assignments < req.assignments:
            return
        req.assignments = assignments
        req.heard_at = time.monotonic()
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
        elif req.owner is not None:
            self.on_release_running(req.owner, rid)
            self._disown(req)
        req.phase = Phase.REMOTE
        if not req.front and not req.subscribers:
            self._forget(req)

    def remote_output(self, delta: RecordedDelta) -> None:
        """Output recorded by the router running it; a gap (events missed)
        reloads the request from Redis."""
        if delta.rid in self._attaching and delta.rid not in self.requests:
            self._attaching[delta.rid].append(delta)
            return
        req = self.requests.get(delta.rid)
        if req is None or req.finished or req.owner is not None:
            return   # not held, or run here now: this is an earlier assignment's
        req.heard_at = time.monotonic()
        if req.phase is Phase.QUEUED:
            self._dequeue(req)
            req.phase = Phase.REMOTE
        if not merge_output(req, delta.tok_start, delta.tokens, delta.txt_start, delta.text,
                            delta.lp_start, delta.lp):
            self.on_reload(req.id)
            return
        take_timings(req, delta.timings)
        if delta.finish is not None:
            take_timings(req, delta.finish)
            finish_from_record(req, delta.finish)
            self._forget(req)
        self._show(req, len(req.tokens), len(req.parts), req.finished)

    def refresh(self, rid: str, rec: dict | None) -> None:
        """A reload after a gap: Redis's output, if longer, and its finish. No
        record at all: Redis lost it (writes it had acknowledged, dropped by a
        restart or failover) and no router can finish it; its client is told."""
        req = self.requests.get(rid)
        if req is None or req.finished or req.owner is not None:
            return
        if rec is None:
            self.metrics.lost_writes.labels("record").inc()
            self.fail(req, "Redis lost this request's record (it dropped writes it had "
                           "acknowledged); send it again")
            return
        if len(rec["tokens"]) > len(req.tokens):
            take_output(req, rec)
        take_timings(req, rec)
        if rec.get("st") == b"f":
            if req.phase is Phase.QUEUED:
                self._dequeue(req)
            finish_from_record(req, rec)
            self._forget(req)
        self._show(req, len(req.tokens), len(req.parts), req.finished)

    def cancelled_elsewhere(self, rid: str) -> None:
        """A front cancelled a request this router runs (Redis already finished it)."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        if req.owner is not None:
            self.on_cancel_running(req.owner, rid)
            self._disown(req)
        self._finish(req, CANCELLED, "", "elsewhere")
        self._show(req, len(req.tokens), len(req.parts), True)
        self._forget(req)

    def step_dropped(self, req: RequestState, before: tuple, finished_by_step: bool) -> None:
        """Redis refused a delta: the request had moved on (requeued, adopted by
        another router, finished there). What the delta added is taken back, and
        this router stops running it; a front reads it again from Redis."""
        n_tok, n_parts, n_lp, text_bytes = before
        del req.tokens[n_tok:], req.parts[n_parts:], req.logprobs[n_lp:]
        req.text_bytes = text_bytes
        req.visible_tokens = min(req.visible_tokens, n_tok)
        req.visible_parts = min(req.visible_parts, n_parts)
        if req.finished and not finished_by_step:
            return   # ended here meanwhile; that finish is on its way to Redis
        if req.owner is not None:
            self.on_cancel_running(req.owner, req.id)
            self._disown(req)
        req.phase = Phase.REMOTE
        req.finish_reason, req.error, req.finish_visible = 0, "", False
        if req.front or req.subscribers:
            self.requests[req.id] = req
            self.on_reload(req.id)
        else:
            self._forget(req)

"""This router's event stream (`P ev:<router id>`): what other routers sharing
the Redis tell it, read with XREAD BLOCK and applied in stream order.

| k | from | meaning |
|---|---|---|
| q | SUBMIT, REQUEUE, MOVE, sweeps | the shared queue has work: wake the pullers |
| a | POP | another router took a request this one fronts (its run side moved) |
| m | ADOPT | a replica took a request this router ran to another router |
| d | STEP, FINISH | output (at its byte offsets) and finish of a request this router fronts |
| c | FINISH, ABANDON | a front ended a request this router runs: cancel it on its replica |

Events are written in the same script as what they report, so they are
durable when read. A front applies output by offset (record.merge_output):
a delta seen twice adds nothing, and one that starts past what the front
has (it missed events: the stream is MAXLEN-bounded) makes it reload the
request from Redis. A read that fails or misses its deadline is retried
from the last event applied, with backoff, like every Redis write.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from router.persistence.store import unpack_tokens
from router.requests.record import RecordedDelta

log = logging.getLogger(__name__)

_TIMING_FIELDS = ("ft", "fs", "ct")
_FINISH_FIELDS = ("fr", "err", "rep", "fin", "pre", "asg", "rq")


def recorded_delta(fields: dict) -> RecordedDelta:
    """A 'd' event (field names decoded, values bytes) as the table takes it."""
    finish = None
    if fields.get("f") == b"1":
        finish = {k: fields.get(k, b"") for k in _FINISH_FIELDS}
    return RecordedDelta(
        rid=fields["id"].decode(), assignments=int(fields.get("n") or 0),
        tok_start=int(fields.get("o") or 0) // 4, tokens=unpack_tokens(fields.get("t")),
        txt_start=int(fields.get("xo") or 0), text=fields.get("x") or b"",
        lp_start=int(fields.get("lo") or 0), lp=fields.get("l") or b"",
        timings={k: fields[k] for k in _TIMING_FIELDS if fields.get(k)}, finish=finish)


class EventReader:
    def __init__(self, store, table, scheduler, router_id: str, timeout: float):
        self.store = store
        self.table = table
        self.scheduler = scheduler
        self.router_id = router_id
        # XREAD BLOCK must return within the connection's deadline.
        self.block_ms = max(50, int(min(1.0, timeout / 2) * 1000))
        self.last_id = "0-0"
        self.applied = 0
        self._task: asyncio.Task | None = None
        self._reloads: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="router-events")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._reloads) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                events = await self.store.read_events(self.router_id, self.last_id, self.block_ms, 1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away or slow: read again from the last event
                log.warning("reading router events failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            for event_id, raw in events:
                self.last_id = event_id.decode() if isinstance(event_id, bytes) else event_id
                try:
                    self.apply({k.decode(): v for k, v in raw.items()})
                except Exception:
                    log.exception("applying router event %s failed", self.last_id)
            self.applied += len(events)

    def apply(self, fields: dict) -> None:
        kind = fields.get("k")
        if kind == b"q":
            self.scheduler.work_arrived()
        elif kind == b"d":
            self.table.remote_output(recorded_delta(fields))
        elif kind in (b"a", b"m"):
            self.table.run_moved(fields["id"].decode(), int(fields.get("n") or 0))
        elif kind == b"c":
            self.table.cancelled_elsewhere(fields["id"].decode())
        else:
            log.warning("unknown router event %r", fields)

    def reload(self, rid: str) -> None:
        """Reads a request back from Redis (a front that missed some of its events)."""
        task = asyncio.get_running_loop().create_task(self._reload(rid))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    def check_after_outage(self) -> None:
        """The writes' connection to Redis was made again. Had Redis restarted
        having lost writes it acknowledged, queued requests it stored may be gone
        (a pop would never find them): those are stored again (table.resubmit_lost)."""
        task = asyncio.get_running_loop().create_task(self._check_after_outage())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _check_after_outage(self) -> None:
        ids = self.table.stored_queued_ids()
        missing = await self._until_read(self.store.missing, ids, what="checking queued requests "
                                         "after a Redis outage")
        self.table.resubmit_lost(missing)

    async def _reload(self, rid: str) -> None:
        [rec] = await self._until_read(self.store.load_requests, [rid], what=f"reloading request {rid}")
        self.table.refresh(rid, rec)

    @staticmethod
    async def _until_read(read, arg, what: str):
        """read(arg), retried with backoff until Redis answers: giving up would leave
        a queued request Redis lost unstored (never popped) or a front's request
        stale for good. A router cut off for longer is fenced and starts over, which
        cancels these (stop)."""
        for attempt in itertools.count():
            try:
                return await read(arg)
            except Exception as exc:
                if attempt % 20 == 0:
                    log.warning("%s failed (%s); retrying until Redis answers", what, exc)
                await asyncio.sleep(min(0.05 * 2 ** min(attempt, 5), 1.0))

"""The one ordered path of every Redis write the router makes.

Writes are queued in the order the router's memory changed and flushed by one
task: everything pending (up to a batch) goes in one pipelined round trip, and
consecutive calls of one script merge into one call. Up to `max_in_flight`
batches are out at once (`--redis-max-in-flight`, default 1): with more, a
write queued while a batch awaits its replies (a pop behind a step write) is
sent at once instead of a round trip later. On loopback Redis a window of 4
measured no clear gain at 1 output token and 20-40% less 64-token throughput,
as batches got smaller (benchmarks/results/history/router_overhead_device_5f668d0.json),
hence the default; a Redis further away is where it may pay. One connection
carries every batch, so Redis applies them in order, and Redis always holds
a prefix of the router's history.

Failure model:
- every round trip has a deadline (`timeout`); a missed deadline or a lost
  connection fails the attempt, the connection is dropped and every batch
  from the failed one on is sent again, in order, with backoff, until it
  succeeds. Scripts are idempotent (lua.py), so a batch that ran before its
  reply was lost runs again safely.
- nothing accepted is dropped: a write is never failed for a transient fault.
  `accepting()` tells new work (submits) to go away instead: past a bound on
  pending submits, or while Redis has not answered for a whole deadline.
- an error reply that no retry can fix (a script bug) fails that one write,
  loudly, and the rest of the batch goes on.
- a batch of middle output only (lua.STEP's plain deltas: no first token, no
  finish, no submit or pop) may wait up to `linger` seconds, counted from its
  oldest write, for more to join it, unless `linger_items` deltas are waiting
  (`--redis-step-linger-ms`). Redis's CPU a delta falls with the deltas a call
  carries, and with several routers on one Redis each router's own batches
  shrink (benchmarks/router/NOTES.md); what waits is only what a client sees
  after it is durable (the first token and the finish are shown at once),
  and any other write sends the whole batch at once.
- `stalled` is set while a batch has waited longer than `stall_after`; the
  router then serves clients from memory (the replicas keep every delta the
  router has not acknowledged, so nothing shown is lost if the router dies).
- every script call carries the router's fence (id, epoch; lua.FENCE). A
  FENCED reply means this router has lost its lease: the writer stops, fails
  what is pending, and calls on_fenced; the router then starts over.

Each write's `on_done` runs once it is durable, in write order.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import hiredis

from router.persistence.resp import LeanRedis, ReplyError, Script

log = logging.getLogger(__name__)

# Error replies that mean "not now" rather than "never": retried like a lost connection.
# OOM (maxmemory reached: results expire, memory comes back), MISCONF (snapshots
# failing: writes refused until the disk is fixed) and NOREPLICAS (too few replicas
# acknowledge) are an outage of writes, not a refusal of this one.
TRANSIENT_REPLIES = ("NOSCRIPT", "LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "READONLY",
                     "OOM", "MISCONF", "NOREPLICAS")
# Of those, replies that the same connection would give for ever: the server forgot
# the scripts loaded when it opened (SCRIPT FLUSH, a restart behind a proxy that kept
# the client's connection), or it is no longer the master the address now leads to
# (a failover). They are retried on a new connection, which loads the scripts again.
CONNECTION_BOUND_REPLIES = ("NOSCRIPT", "READONLY", "MASTERDOWN")


@dataclass(eq=False)
class Write:
    """One write. Writes with the same script and header merge into one call:
    the call's ARGV is the header then every write's items. A write with no
    script and no items is a barrier: done once every earlier write is."""

    script: Script | None
    header: tuple = ()
    items: tuple | list = ()
    reply_arity: int = 0             # replies per item in a merged call; -1: own call, whole reply
    item_args: int = 1               # arguments per item (splits a merged call's reply)
    item_count: int = 0              # items, when they differ in length (else len(items) / item_args)
    numkeys: int = 0
    on_done: Callable[[object], None] | None = None
    bounded: bool = False            # counts against the pending-submit bound
    lingers: bool = False            # may wait for a fuller batch (middle output only)
    future: asyncio.Future | None = field(default=None, repr=False)

    @property
    def mergeable(self) -> bool:
        return self.script is not None and self.reply_arity >= 0

    @property
    def count(self) -> int:
        """Items in this write (its share of a merged call's reply)."""
        return self.item_count or len(self.items) // self.item_args


class PermanentWriteError(RuntimeError):
    """Redis refused a write in a way no retry can fix (a script error)."""


class RedisWriter:
    def __init__(self, client: LeanRedis, *, max_pending_submits: int, stall_after: float,
                 max_batch: int = 512, max_in_flight: int = 1, reply_timeout: float = 5.0,
                 linger: float = 0.0, linger_items: int = 64,
                 on_stall: Callable[[bool], None] | None = None):
        self.client = client
        self.linger = linger
        self.linger_items = linger_items
        self.reply_timeout = reply_timeout
        self.max_in_flight = max_in_flight
        self.max_pending_submits = max_pending_submits
        self.stall_after = stall_after
        self.max_batch = max_batch
        self.on_stall = on_stall
        self.round_trips = 0
        self.fence: tuple[str, str] = ("", "")     # (router id, epoch); unfenced until set
        self.fenced = False
        self.on_fenced: Callable[[str], None] = lambda reason: None
        self.failing_since: float | None = None   # monotonic time of the first failed attempt
        self.stalled = False
        # Every write not yet durable, in order; the first _unsent_from are in
        # the flights (sent batches awaiting replies, oldest first).
        self._pending: collections.deque[Write] = collections.deque()
        self._unsent_from = 0
        self._flights: collections.deque[_Flight] = collections.deque()
        self._pending_submits = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        # call_timed's futures with their expiry (loop time), in call order: one
        # timeout for all, so the oldest expires first and one timer suffices.
        self._timed: collections.deque[tuple[float, asyncio.Future]] = collections.deque()
        self._timed_timer: asyncio.TimerHandle | None = None
        # The unsent writes as lingering sees them: since when the oldest waits,
        # how many deltas they carry, and whether one of them may not wait.
        self._unsent_since: float | None = None
        self._unsent_items = 0
        self._unsent_urgent = False
        self._linger_timer: asyncio.TimerHandle | None = None

    # ---- queueing ----
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-writer")

    def post(self, write: Write) -> Write:
        """Queues a write; its on_done runs once it is durable. Once fenced, a
        write fails at once (its future; on_done never runs)."""
        if self.fenced:
            if write.future is not None and not write.future.done():
                write.future.set_exception(PermanentWriteError("this router was fenced"))
            return write
        self._pending.append(write)
        if write.bounded:
            self._pending_submits += 1
        if self.linger:
            if self._unsent_since is None:
                self._unsent_since = time.monotonic()
            self._unsent_items += write.count
            self._unsent_urgent = self._unsent_urgent or not write.lingers
        self._idle.clear()
        if len(self._flights) < self.max_in_flight:
            # Otherwise the window is full and the flush loop sleeps until a
            # flight's replies come: waking it per write would only cost a turn.
            self._wake.set()
        return write

    def call(self, write: Write) -> asyncio.Future:
        """Queues a write and returns a future of its reply (or of a PermanentWriteError)."""
        write.future = asyncio.get_running_loop().create_future()
        self.post(write)
        return write.future

    def call_timed(self, write: Write) -> asyncio.Future:
        """As call, but the future fails with TimeoutError once reply_timeout has
        passed without the reply; the write itself stays queued (nothing
        accepted is dropped). One lazy timer for all, not one per call: this is
        every submit's path."""
        future = self.call(write)
        loop = asyncio.get_running_loop()
        timed = self._timed
        while timed and timed[0][1].done():
            timed.popleft()
        timed.append((loop.time() + self.reply_timeout, future))
        if self._timed_timer is None:
            self._timed_timer = loop.call_at(timed[0][0], self._expire_timed)
        return future

    def _expire_timed(self) -> None:
        self._timed_timer = None
        loop = asyncio.get_running_loop()
        now, timed = loop.time(), self._timed
        while timed and (timed[0][1].done() or timed[0][0] <= now):
            _, future = timed.popleft()
            if not future.done():
                future.set_exception(TimeoutError(f"no reply from Redis within {self.reply_timeout:g} s"))
        if timed:
            self._timed_timer = loop.call_at(timed[0][0], self._expire_timed)

    def accepting(self) -> str | None:
        """None when new submits may be queued, else why not."""
        if self.failing_since is not None and time.monotonic() - self.failing_since > self.client.timeout:
            return (f"Redis has not answered for {time.monotonic() - self.failing_since:.1f} s "
                    f"(the router retries every write, but takes no new requests meanwhile)")
        if self._pending_submits >= self.max_pending_submits:
            return f"{self._pending_submits} submits are waiting for Redis (the bound)"
        return None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        """Batches sent and awaiting their replies."""
        return len(self._flights)

    async def drain(self, timeout: float) -> bool:
        """Waits until everything queued so far is durable; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def stop(self) -> None:
        for timer in (self._timed_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._timed_timer = self._linger_timer = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.client.close()

    # ---- the flush loop ----
    async def _run(self) -> None:
        backoff = 0.05
        while not self.fenced:
            if self._unsent_from < len(self._pending) and len(self._flights) < self.max_in_flight:
                if self.linger and self._lingering():
                    self._wake.clear()
                    await self._wake.wait()   # a write that ends the wait, or its timer
                    continue
                await self._start_next()
                continue
            if not self._flights:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            flight = self._flights[0]
            if not flight.done():
                self._wake.clear()
                await self._wake.wait()   # its last reply, or a new write for the window
                continue
            self._flights.popleft()
            try:
                replies = flight.replies()
            except (_Fenced, _Failed) as exc:
                if self._failed(flight, exc):
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            for _ in flight.batch:
                w = self._pending.popleft()
                if w.bounded:
                    self._pending_submits -= 1
            self._unsent_from -= len(flight.batch)
            if self.failing_since is not None:
                log.warning("Redis answers again after %.1f s", time.monotonic() - self.failing_since)
            self.failing_since = None
            backoff = 0.05
            self._settle_stall(time.monotonic() - flight.started)
            self._complete(flight.batch, replies)

    def _lingering(self) -> bool:
        """Whether the unsent writes wait for more to join them: all may wait,
        they carry fewer than linger_items deltas, and the oldest has waited
        less than linger. The timer that ends the wait is armed here."""
        if self._unsent_urgent or self._unsent_items >= self.linger_items:
            return False
        left = self._unsent_since + self.linger - time.monotonic()
        if left <= 0:
            return False
        if self._linger_timer is None:
            self._linger_timer = asyncio.get_running_loop().call_later(left, self._linger_over)
        return True

    def _linger_over(self) -> None:
        self._linger_timer = None
        self._wake.set()

    async def _start_next(self) -> None:
        """Sends the next batch of unsent writes, without waiting for its replies."""
        # One turn of the loop first: what the tasks woken with this one write
        # (the pop an arrival or a flight's replies kicked) joins this batch
        # instead of waiting a round trip for the next.
        await asyncio.sleep(0)
        if self.fenced or self._unsent_from >= len(self._pending):
            return
        first = self._unsent_from
        batch = [self._pending[i] for i in range(first, min(len(self._pending), first + self.max_batch))]
        self._unsent_from += len(batch)
        if self.linger:
            if self._unsent_from == len(self._pending):
                self._unsent_since, self._unsent_items, self._unsent_urgent = None, 0, False
            else:
                self._unsent_urgent = True   # past max_batch: the rest goes next, at once
        flight = _Flight(batch, time.monotonic())
        self._flights.append(flight)
        self._arm_stall_timer()
        wire = flight.encode(self.fence)
        if not wire:
            return   # barriers only: done once the flights before it are
        self.round_trips += 1
        try:
            flight.future = await self.client.send(wire)
        except Exception as exc:  # could not connect: the flight fails as its replies would
            flight.error = exc
        if flight.future is not None:
            flight.future.add_done_callback(self._flight_done)

    def _flight_done(self, _future) -> None:
        self._wake.set()

    def _failed(self, flight: "_Flight", exc: Exception) -> bool:
        """A flight failed: every later one is discarded and all are sent again,
        in order, after a backoff (the scripts are idempotent). True when fenced."""
        self._flights.clear()
        self._unsent_from = 0
        self._unsent_urgent = True   # sent again at once; counting restarts with the next batch
        if self._unsent_since is None:
            self._unsent_since = time.monotonic()
        if isinstance(exc, _Fenced):
            self._fail_all(PermanentWriteError(str(exc)))
            self.fenced = True
            log.error("%s: this router writes no more and starts over", exc)
            self.on_fenced(str(exc))
            return True
        if self.failing_since is None:
            self.failing_since = flight.started
            log.warning("Redis write failed (%s); retrying until Redis answers", exc)
        if getattr(exc, "new_connection", False):
            self.client.close()
        return False

    def _fail_all(self, error: Exception) -> None:
        while self._pending:
            w = self._pending.popleft()
            if w.future is not None and not w.future.done():
                w.future.set_exception(error)
        self._pending_submits = 0
        self._idle.set()

    def _complete(self, batch: list[Write], replies: list) -> None:
        for w, reply in zip(batch, replies):
            if isinstance(reply, ReplyError):
                log.error("Redis refused a write (%s): %s", w.script and w.script.text[:40], reply)
                reply = PermanentWriteError(str(reply))
            if w.future is not None and not w.future.done():
                if isinstance(reply, Exception):
                    w.future.set_exception(reply)
                else:
                    w.future.set_result(reply)
            if w.on_done is not None:
                try:
                    w.on_done(reply)
                except Exception:
                    log.exception("a durable-write callback failed")

    # ---- stall tracking ----
    # One timer, re-armed lazily for the oldest flight: not one set and cancelled
    # per batch, which cost the hot path a timer each round trip.
    def _arm_stall_timer(self) -> None:
        if self._stall_timer is None and not self.stalled:
            self._stall_timer = asyncio.get_running_loop().call_later(self.stall_after, self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        # Since the oldest unanswered attempt: a failed one counts from its first
        # try (retries send the batch again, with a later start).
        since = self.failing_since if self.failing_since is not None else \
            (self._flights[0].started if self._flights else None)
        if self.stalled or since is None:
            return
        waited = time.monotonic() - since
        if waited < self.stall_after:
            self._stall_timer = asyncio.get_running_loop().call_later(self.stall_after - waited,
                                                                      self._check_stall)
            return
        self.stalled = True
        log.warning("Redis is slower than %.2f s: clients are served from memory until it "
                    "catches up", self.stall_after)
        if self.on_stall:
            self.on_stall(True)

    def _settle_stall(self, took: float) -> None:
        if self.stalled and took < self.stall_after and len(self._pending) < self.max_batch:
            self.stalled = False
            if self.on_stall:
                self.on_stall(False)


class _Failed(Exception):
    """A flight's connection, deadline or a transient reply failed it.
    new_connection: the reply would come again on the same connection."""

    def __init__(self, message: str, new_connection: bool = False):
        super().__init__(message)
        self.new_connection = new_connection


class _Fenced(Exception):
    pass


class _Flight:
    """One sent batch: its writes, the commands they became (consecutive calls
    of one script merged) and the future of their replies."""

    def __init__(self, batch: list[Write], started: float):
        self.batch = batch
        self.started = started
        self.spans: list = []    # per write: (command index, first item); None: a barrier
        self.future: asyncio.Future | None = None
        self.error: Exception | None = None

    def encode(self, fence: tuple) -> list:
        commands, last_key = [], None
        for w in self.batch:
            if w.script is None and not w.items:
                self.spans.append(None)
                continue
            key = (w.script.sha, w.header, w.numkeys) if w.mergeable else None
            if key is not None and key == last_key:
                cmd = commands[-1]
                self.spans.append((len(commands) - 1, cmd[1]))
                cmd[1] += w.count
                cmd[2].extend(w.items)
            else:
                commands.append([w, w.count if w.mergeable else 0, list(w.items)])
                self.spans.append((len(commands) - 1, 0))
            last_key = key
        return [tuple(items) if first.script is None else
                first.script.command([*first.header, *items, *fence], first.numkeys)
                for first, _, items in commands]

    def done(self) -> bool:
        return self.error is not None or self.future is None or self.future.done()

    def replies(self) -> list:
        """One reply (or ReplyError) per write; raises _Fenced or _Failed."""
        if self.error is not None:
            raise _Failed(f"{type(self.error).__name__}: {self.error}")
        replies = []
        if self.future is not None:
            exc = self.future.exception()
            if exc is not None:
                raise _Failed(f"{type(exc).__name__}: {exc}")
            replies = [ReplyError(str(r)) if isinstance(r, hiredis.ReplyError) else r
                       for r in self.future.result()]
        for reply in replies:
            if isinstance(reply, ReplyError) and str(reply).startswith("FENCED"):
                raise _Fenced(str(reply))
            if isinstance(reply, ReplyError) and str(reply).startswith(TRANSIENT_REPLIES):
                raise _Failed(f"transient reply: {reply}",
                              new_connection=str(reply).startswith(CONNECTION_BOUND_REPLIES))
        out = []
        for w, span in zip(self.batch, self.spans):
            if span is None:
                out.append(None)
                continue
            index, first_item = span
            reply = replies[index]
            if w.mergeable and w.reply_arity > 0 and not isinstance(reply, ReplyError):
                reply = reply[first_item * w.reply_arity:(first_item + w.count) * w.reply_arity]
            out.append(reply)
        return out

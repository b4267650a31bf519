"""The replica worker's gRPC side: dials the router, turns RouterMessages into
engine commands and engine reports into one StepOutputs message per step.

The engine keeps running while the router is away; on reconnect the worker
re-registers with the requests it holds, resends the deltas the router has
not acknowledged (it drops duplicates by output_offset) and aborts those the
router re-queued. No way a stream can end (a write after the call finished,
a read after a reset, a refused connection) ends the process: each is a
reconnect.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time

import grpc

from common.pb.quadriga.v1 import replica_pb2 as pb
from common.pb.quadriga.v1 import replica_pb2_grpc
from common.router_health import RouterHealth
from replica_worker.engine.errors import InvalidRequestError
from replica_worker.worker import protocol
from replica_worker.worker.coalescing import DeltaCoalescer
from replica_worker.worker.config import WorkerConfig
from replica_worker.worker.credit import PullCredit
from replica_worker.engine.output_text import OutputTexts
from replica_worker.worker.engine_loop import (DEVICE_FAILED_EXIT, AbortRequest, EngineLoop, EngineReport,
                                                exit_now)
from replica_worker.worker.engine_process import EngineProcess
from replica_worker.worker.kv_mirror import KVMirror
from replica_worker.worker.metrics import ReplicaMetrics
from replica_worker.worker.session_state import RequestBook

log = logging.getLogger(__name__)

# How long closing a router channel may take (_close).
CHANNEL_CLOSE_TIMEOUT_S = 5.0
# Messages to the router that may wait while gRPC applies flow control; past it the
# stream is dropped and re-established (the unacknowledged deltas are resent).
OUTBOX_LIMIT = 10_000
# A replica whose engine died hands its work back, then exits within this at most.
ENGINE_DEATH_GRACE_S = 2.0
# An engine that holds requests steps, and reports, continually: one silent this long is
# stuck (a tensor-parallel rank frozen in a collective waits out its 10-30 min timeout,
# while this worker's heartbeats would renew the leases of work that never moves).
ENGINE_STALL_S = 120.0
# How long a router may take to answer Register (its join writes to Redis, which
# it retries through an outage) before the stream counts as broken.
REGISTER_REPLY_TIMEOUT_S = 15.0

# Statuses at registration that no retry can fix: exit instead of reconnecting.
FATAL_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def _exit_now(status: int) -> None:
    log.critical("the engine is gone; the replica exits with status %d", status)
    exit_now(status)


class FatalRegistrationError(RuntimeError):
    pass


class ReplicaWorker:
    def __init__(self, config: WorkerConfig, engine, capacity_msg: pb.ReplicaCapacity):
        self.config = config
        self.capacity_msg = capacity_msg
        self.book = RequestBook()
        self.coalescer = DeltaCoalescer()
        self.credit = PullCredit(prefetch=config.prefetch)
        # The router mirrors the prefix cache from this copy (kv_mirror.py). Read
        # before the engine thread starts: the engine is not thread-safe.
        self.kv: KVMirror | None = None
        if engine.prefix_caching_enabled:
            self.hasher = engine.block_hasher
            self.kv = KVMirror(engine.cached_block_hashes(),
                               max_pending=2 * max(1, capacity_msg.num_kv_blocks))
        if isinstance(engine, EngineProcess):
            # The engine steps in its own process; detokenizing is done here.
            self.engine_loop = engine.attach(self._on_report_from_thread, on_exit=self._engine_died)
            self.texts: OutputTexts | None = engine.output_texts
        else:
            self.engine_loop = EngineLoop(engine, self._on_report_from_thread,
                                          on_device_failure=self._engine_failed)
            self.texts = None  # the engine detokenizes
        self._reports: asyncio.Queue[EngineReport] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: asyncio.Queue | None = None  # the live stream's writer queue; None while away
        self._overflowed = asyncio.Event()          # the live stream's outbox filled: end it
        self._health = RouterHealth()
        self._rng = random.Random(config.replica_id)
        self._address: str | None = None   # the router dialled last
        self._last_report: EngineReport | None = None
        self._last_report_at = time.monotonic()
        self._lease_ttl_s = 10.0
        self._heartbeat_s = 1.0
        self._disconnected_at: float | None = None
        self._step_credit = False   # this session's router applies StepOutputs.pull
        self._last_heard = time.monotonic()   # the last message from the router
        self.draining = False
        self._drain_deadline = float("inf")
        self._done = asyncio.Event()
        self.metrics = ReplicaMetrics(config.model_name)

    # ---- engine thread -> event loop ----
    def _on_report_from_thread(self, report: EngineReport) -> None:
        self._loop.call_soon_threadsafe(self._reports.put_nowait, report)

    # ---- the engine cannot go on ----
    def _engine_failed(self, exc: BaseException) -> None:
        """EngineLoop's on_device_failure (the engine on this process's thread)."""
        log.critical("engine cannot go on (%s)", exc)
        self._engine_died(DEVICE_FAILED_EXIT)

    def _engine_died(self, status: int) -> None:
        """From the engine's thread or its report reader: the engine is gone. The
        replica ends with `status` (its supervisor restarts it), but first hands
        every request in hand back, so the router resumes them now rather than a
        lease later. Best effort, bounded: the exit comes within ENGINE_DEATH_GRACE_S
        whatever the stream does, and a hand-back that never arrives leaves the
        lease to lapse, as before."""
        threading.Timer(ENGINE_DEATH_GRACE_S, _exit_now, args=(status,)).start()
        loop = self._loop
        if loop is None or loop.is_closed():
            _exit_now(status)
        loop.call_soon_threadsafe(lambda: loop.create_task(self._hand_back_then_exit(status)))

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(min(ENGINE_STALL_S / 4, 5.0))
            report, silent = self._last_report, time.monotonic() - self._last_report_at
            if report is not None and report.request_ids and silent > ENGINE_STALL_S:
                log.critical("the engine holds %d requests and has reported nothing for %.0f s: "
                             "it is stuck", len(report.request_ids), silent)
                self._engine_died(DEVICE_FAILED_EXIT)
                return

    async def _hand_back_then_exit(self, status: int) -> None:
        try:
            ids = self.book.unfinished
            if ids and self._outbox is not None:
                self._hand_back(ids)
                outbox = self._outbox
                while outbox is self._outbox and not outbox.empty():
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)   # the last write leaves the process
        finally:
            _exit_now(status)

    # ---- lifecycle ----
    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        pump = sessions = watchdog = None
        try:
            # Inside the try: a failure here (a metrics port taken) still stops the
            # engine, which would otherwise keep the process from exiting.
            if self.config.metrics_port:
                self.metrics.serve(self.config.metrics_port)
            self.engine_loop.start()
            pump = asyncio.create_task(self._pump_reports())
            sessions = asyncio.create_task(self._connect_forever())
            watchdog = asyncio.create_task(self._watch_engine())
            await asyncio.wait({pump, sessions}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                # Reports are how output leaves: with the pump gone the worker would
                # renew its leases and send nothing. End it, so its work resumes elsewhere.
                sessions.cancel()
                await asyncio.gather(sessions, return_exceptions=True)
                pump.result()
                raise RuntimeError("the engine's reports stopped being read")
            sessions.result()
        finally:
            tasks = [t for t in (pump, sessions, watchdog) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.engine_loop.stop()

    def begin_drain(self) -> None:
        """Stop taking work; finish what runs (for drain_timeout_s), hand back the rest, exit."""
        if not self.draining:
            log.info("draining: %d requests in hand", len(self.book.live))
            self.draining = True
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
            self._check_drained()

    def _check_drained(self) -> None:
        if self.draining and not self.book.live and not self._done.is_set():
            self._done.set()
            self._send(None)  # half-close: the router ends the stream, the session sees EOF

    async def _connect_forever(self) -> None:
        backoff = self.config.reconnect_min_s
        while not self._done.is_set():
            channel = self._channel()
            try:
                await self._session(channel)
                backoff = self.config.reconnect_min_s
            except FatalRegistrationError:
                raise
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                log.warning("router stream broke: %s", getattr(exc, "details", lambda: exc)())
            except Exception:
                # Whatever ended the stream, the engine and its work live on.
                log.exception("router session failed; reconnecting")
            finally:
                self.credit.reset()
                await self._close(channel)
            if self._done.is_set():
                return
            self._health.failed(self._address)
            self._disconnected_at = self._disconnected_at or time.monotonic()
            self._expire_if_leases_lapsed()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.reconnect_max_s)

    @staticmethod
    async def _close(channel) -> None:
        """Closes the channel within CHANNEL_CLOSE_TIMEOUT_S: a worker that drained
        must exit, and a close left waiting on a stream its router ended (seen once,
        with a router shutting down as the worker half-closed) would hold it."""
        try:
            await asyncio.wait_for(channel.close(), CHANNEL_CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the router channel did not close within %.0f s; leaving it", CHANNEL_CLOSE_TIMEOUT_S)

    def _next_router(self) -> str:
        """The first router at first (another drawn at random if it is known to be
        down); after a stream ended (its router gone, say), another not known to be
        down, drawn at random (common/router_health.py): the replicas of a router
        that died spread over the others."""
        routers = self.config.routers
        if self._address is None:
            self._address = self._health.first(routers, self._rng)
        else:
            self._address, _ = self._health.after(routers, self._address, self._rng)
        return self._address

    def _channel(self) -> grpc.aio.Channel:
        # Pings every few seconds: a router that froze (its process stopped, the
        # network gone without a reset) ends the stream in about 8 s, and the
        # worker moves on, instead of waiting for TCP to give up. gRPC core times
        # a ping out only after ping_timeout_ms (a minute by default).
        options = [("grpc.keepalive_time_ms", 3_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.http2.ping_timeout_ms", 5_000),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        if self.config.tls_ca_file:
            with open(self.config.tls_ca_file, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            return grpc.aio.secure_channel(self._next_router(), creds, options=options)
        return grpc.aio.insecure_channel(self._next_router(), options=options)

    def _expire_if_leases_lapsed(self) -> None:
        """Away longer than a lease: the router has re-queued our work; drop it here.

        A drain that runs out of time while the router is away drops its work
        too: the hand back cannot be sent, and the leases lapse in the router,
        which requeues it.
        """
        now = time.monotonic()
        lease_lapsed = self._disconnected_at and now - self._disconnected_at > self._lease_ttl_s
        if lease_lapsed or (self.draining and now > self._drain_deadline):
            for rid in list(self.book.live):
                self.engine_loop.submit(AbortRequest(rid))
                self.book.dropped(rid)
            self._check_drained()

    # ---- one router session ----
    async def _session(self, channel) -> None:
        call = replica_pb2_grpc.ReplicaGatewayStub(channel).Connect()
        await call.write(pb.ReplicaMessage(register=pb.Register(
            replica_id=self.config.replica_id,
            model=self.config.model_name,
            capacity=self.capacity_msg,
            scheduler=self.config.scheduler,
            auth_token=self.config.auth_token,
            held_request_ids=list(self.book.live),
            prefix_cache=self._prefix_cache_pb(),
        )))
        try:
            first = await self._registered_reply(call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in FATAL_CODES:
                raise FatalRegistrationError(
                    f"router refused registration: {exc.code().name}: {exc.details()}") from None
            raise
        if first is None:
            return   # drained with nothing in hand while the router had not answered
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "registered":
            await self._raise_registration_failure(call)
        # One writer per stream: gRPC allows a single write in flight, so every
        # message goes through this queue (None half-closes the stream).
        self._outbox = asyncio.Queue(OUTBOX_LIMIT)
        self._overflowed = asyncio.Event()
        tasks = [asyncio.create_task(self._write_loop(call, self._outbox)),
                 asyncio.create_task(self._read_loop(call)),
                 asyncio.create_task(self._heartbeats()),
                 asyncio.create_task(self._until_overflow(self._overflowed))]
        self._on_registered(first.registered)
        if self._done.is_set():
            # Drained while registering (nothing was in hand): the half-close
            # _check_drained sent found no outbox then, and without it the router
            # and this worker would wait on each other for good.
            self._send(None)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._outbox = None
            if self.kv is not None:
                self.kv.end_session()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()  # re-raise what ended the session

    async def _registered_reply(self, call):
        """The router's first message, or None once this worker is done (drained
        with nothing in hand) and its drain time has run out before the reply
        came (a reply within it still gets the half-close the drain owes). A
        router whose join waits on Redis may take a while; past
        REGISTER_REPLY_TIMEOUT_S the stream is given up as broken, and the worker
        tries again (another router, where it knows one)."""
        read = asyncio.ensure_future(call.read())
        deadline = time.monotonic() + REGISTER_REPLY_TIMEOUT_S
        try:
            while True:
                done_waiter = None
                if self._done.is_set():
                    deadline = min(deadline, self._drain_deadline)
                else:
                    done_waiter = asyncio.ensure_future(self._done.wait())
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waits = {read} if done_waiter is None else {read, done_waiter}
                finished, _ = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if done_waiter is not None:
                    done_waiter.cancel()
                if read in finished:
                    return read.result()
        finally:
            if not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
        if self._done.is_set():
            return None
        raise ConnectionError(f"the router did not answer Register within {REGISTER_REPLY_TIMEOUT_S:g} s")

    def _prefix_cache_pb(self) -> pb.PrefixCache | None:
        """The whole cache, for Register: a router that restarted, or a stream that
        came back, starts from the truth; StepOutputs carry the changes after it."""
        if self.kv is None:
            return None
        h = self.hasher
        return pb.PrefixCache(block_size=h.block_size, hash_scheme=h.scheme, hash_salt=h.salt,
                              block_hashes=self.kv.snapshot())

    def _kv_events_pb(self) -> pb.KVEvents | None:
        events = self.kv.take() if self.kv is not None else None
        if events is None:
            return None
        return pb.KVEvents(stored=events.stored, evicted=events.evicted, cleared=events.cleared)

    def _send_kv_events(self) -> None:
        """Changes with no deltas to ride on: a StepOutputs of KV events alone
        (not acknowledged: it holds nothing the router could lose)."""
        events = self._kv_events_pb()
        if events is not None:
            self._send(pb.ReplicaMessage(step=pb.StepOutputs(kv_events=events)))

    def _send(self, msg: pb.ReplicaMessage | None) -> None:
        if self._outbox is None:
            return
        try:
            self._outbox.put_nowait(msg)
        except asyncio.QueueFull:
            # Ends the session like any broken stream (then a reconnect). Cancelling
            # the call instead would raise CancelledError in its reads and writes,
            # which ends the worker, not the session.
            self._overflowed.set()

    @staticmethod
    async def _until_overflow(overflowed: asyncio.Event) -> None:
        await overflowed.wait()
        raise ConnectionError(f"{OUTBOX_LIMIT} messages to the router are unsent; "
                              "re-establishing the stream")

    async def _write_loop(self, call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                msg = await outbox.get()
                if msg is None:
                    await call.done_writing()
                    await asyncio.Event().wait()  # the read loop ends the session at EOF
                await call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            # The call ended under a write (router gone, stream reset): the session ends.
            log.info("router stream closed while writing: %s", type(exc).__name__)

    async def _read_loop(self, call) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            self._last_heard = time.monotonic()
            self._on_router_message(msg)

    def _router_stopped_answering(self) -> bool:
        """The router owes Acks and has sent nothing for half a lease: it froze
        or was cut off. HTTP/2 keepalive misses this when steps have filled the
        stream's buffers (the ping is never written), so the worker ends the
        stream itself and moves to the next router before its leases lapse."""
        return bool(self.book.unacknowledged()) and \
            time.monotonic() - self._last_heard > self._lease_ttl_s / 2

    async def _raise_registration_failure(self, call) -> None:
        code = await call.code()
        details = await call.details()
        if code in FATAL_CODES:
            raise FatalRegistrationError(f"router refused registration: {code.name}: {details}")
        raise ConnectionError(f"registration failed: {code}: {details}")

    def _on_registered(self, reg: pb.Registered) -> None:
        self._health.served(self._address)
        self._last_heard = time.monotonic()
        self._lease_ttl_s = reg.lease_ttl_s or self._lease_ttl_s
        self._heartbeat_s = reg.heartbeat_interval_s or self._heartbeat_s
        self._disconnected_at = None
        self._step_credit = reg.step_credit
        resend, abort = self.book.replay(set(reg.keep_request_ids))
        for rid in abort:
            self.engine_loop.submit(AbortRequest(rid))
        if resend:
            self._send(pb.ReplicaMessage(step=pb.StepOutputs(step_id=self.book.next_seq(),
                                                             deltas=resend)))
        # Changes since the Register's snapshot, while the router was answering.
        self._send_kv_events()
        log.info("registered with router (policy %s); kept %d, dropped %d",
                 reg.policy, len(set(reg.keep_request_ids)), len(abort))
        self._check_drained()
        self.engine_loop.request_report()  # fresh capacity -> first Pull of this session

    def _on_router_message(self, msg: pb.RouterMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "assign":
            self._on_assign(msg.assign.assignments)
        elif kind == "cancel":
            for rid in msg.cancel.request_ids:
                if rid in self.book.live:
                    self.engine_loop.submit(AbortRequest(rid))
                    self.book.dropped(rid)
            self._check_drained()
        elif kind == "drain":
            self.begin_drain()
        elif kind == "ack":
            self.book.acknowledged(msg.ack.step_id)
            self._check_drained()

    def _on_assign(self, assignments) -> None:
        rejected = []
        tokens = 0
        for a in assignments:
            context = len(a.prompt_token_ids) + len(a.resume_token_ids)
            tokens += context
            self.book.assigned(a.request_id, context, len(a.resume_token_ids))
            self.coalescer.assigned(a.request_id, a.stream_interval)
            try:
                command = protocol.add_request_from_pb(a)
            except InvalidRequestError as exc:
                rejected.append(pb.RequestDelta(
                    request_id=a.request_id, output_offset=len(a.resume_token_ids),
                    finish_reason=protocol.FINISH_REASONS["error"], error=str(exc)))
                continue
            if self.texts is not None:
                self.texts.add(a.request_id, list(command.resume_token_ids), command.params,
                               command.resume_text_len, command.prompt_token_ids)
            self.engine_loop.submit(command)
        self.credit.on_assigned(len(assignments), tokens)
        if rejected:
            self._send_deltas(rejected)
            # Their credit is spent and no engine step may follow (an idle
            # engine reports only when it has work): ask for a report so the
            # capacity they never took is granted again.
            self.engine_loop.request_report()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if self._router_stopped_answering():
                log.warning("the router sent nothing for %.1f s while %d deltas wait for its Ack; "
                            "moving on", time.monotonic() - self._last_heard,
                            self.book.unacknowledged())
                return   # ends the session: the worker dials the next router
            load = self._last_report.load if self._last_report else None
            self._send(pb.ReplicaMessage(heartbeat=pb.Heartbeat(
                running=load.running if load else 0,
                waiting=load.waiting if load else 0,
                free_kv_blocks=load.free_kv_blocks if load else 0,
                total_kv_blocks=load.total_kv_blocks if load else 0,
                request_ids=self.book.unfinished,
            )))
            if self.draining and time.monotonic() > self._drain_deadline:
                self._hand_back_all()

    def _send_deltas(self, deltas: list[pb.RequestDelta]) -> None:
        """Deltas outside an engine report, in a StepOutputs of their own."""
        if not deltas:
            return
        seq = self.book.next_seq()
        deltas = [d for d in deltas if self.book.record(d, seq)]
        if deltas:
            self._send(pb.ReplicaMessage(step=pb.StepOutputs(step_id=seq, deltas=deltas)))

    def _hand_back(self, ids) -> None:
        """The engine gave these up after a recoverable error (they hold no KV any
        more): the router resumes them, here or elsewhere, from what it recorded."""
        self._send_deltas(self.coalescer.release(ids))
        for rid in ids:
            self.book.dropped(rid)
        log.warning("handing %d requests back to the router after an engine error", len(ids))
        self._send(pb.ReplicaMessage(hand_back=pb.HandBack(request_ids=list(ids))))
        self._check_drained()

    def _hand_back_all(self) -> None:
        ids = self.book.unfinished
        for rid in ids:
            self.engine_loop.submit(AbortRequest(rid))
        self._send_deltas(self.coalescer.release(ids))
        for rid in ids:
            self.book.dropped(rid)
        if ids:
            log.info("drain timeout: handing back %d requests", len(ids))
            self._send(pb.ReplicaMessage(hand_back=pb.HandBack(request_ids=ids)))
        self._check_drained()

    # ---- engine reports -> StepOutputs and Pull ----
    async def _pump_reports(self) -> None:
        while True:
            report = await self._reports.get()
            self._last_report = report
            self._last_report_at = time.monotonic()
            self.metrics.observe(report)
            self._send_report(report)
            self._check_drained()

    def _with_text(self, deltas: list) -> list:
        """The engine runs in another process: each delta's text, and its stop
        strings, are found here. A stop string ends the request here and in the
        engine, whose tokens for it from the step it computed meanwhile are dropped."""
        texts = self.texts
        out = []
        for d in deltas:
            if d.request_id not in texts:
                if not d.new_token_ids:
                    out.append(d)
                continue  # ended here by a stop string, or dropped
            final = d.finish_reason is not None
            # The engine ends a request "stop" only on a token (EOS, a stop id):
            # stop strings are found here.
            d.text, stop_string_hit = texts.extend(d.request_id, d.new_token_ids, final,
                                                   stop_token=d.finish_reason == "stop")
            if stop_string_hit:
                if not final:
                    self.engine_loop.submit(AbortRequest(d.request_id))
                d.finish_reason = "stop"
            if d.finish_reason is not None:
                texts.remove(d.request_id)
            out.append(d)
        texts.retain(self.book.live)
        return out

    def _send_report(self, report: EngineReport) -> None:
        res = report.result
        if self.kv is not None and report.kv_events is not None:
            self.kv.apply(report.kv_events)
        self.book.engine_holds(report.request_ids)
        if report.handed_back:
            self._hand_back(report.handed_back)
        connected = self._outbox is not None
        res.deltas = [d for d in res.deltas if self.book.of_this_assignment(
            d.request_id, d.output_offset, len(d.new_token_ids))]
        if self.texts is not None:
            res.deltas = self._with_text(res.deltas)
        deltas = []
        seq = self.book.next_seq() if res.deltas else 0
        for d in res.deltas:
            msg = self.coalescer.offer(protocol.delta_to_pb(d, self.book.first_scheduled_sent(d.request_id)))
            if msg is not None and self.book.record(msg, seq):
                deltas.append(msg)
        self.coalescer.retain(self.book.live)
        if not connected:
            return
        grant = None if self.draining else \
            self.credit.grant(report.capacity, len(self.book.queued), self.book.queued_tokens)
        pull = pb.Pull(max_requests=grant[0], max_prompt_tokens=grant[1]) if grant else None
        if deltas:
            step = pb.StepOutputs(
                step_id=seq, deltas=deltas, batch_size=res.batch_size,
                num_tokens=res.num_tokens, step_time_s=res.step_time,
                free_kv_blocks=report.load.free_kv_blocks, kv_events=self._kv_events_pb())
            if pull is not None and self._step_credit:
                step.pull.CopyFrom(pull)  # the credit this step's finishes freed rides with them
                pull = None
            self._send(pb.ReplicaMessage(step=step))
        else:
            self._send_kv_events()
        if pull is not None:
            self._send(pb.ReplicaMessage(pull=pull))

"""Builds and runs the router: grpc.aio server with the client API, the replica
gateway, health and reflection, plus the Prometheus HTTP endpoint.

Wiring, top down (arrows run downwards only):
  front ends, replica gateway ──▶ admission ──▶ request table ──▶ store + writer
                             └──▶ replica ops ──▶ pull scheduler ──┘

A graceful stop (SIGTERM, what every rollout sends) cancels nothing: new work
is refused, assignment stops, replica streams end (replicas keep running and
re-register with the next router), pending writes are made durable, and then
client streams end with UNAVAILABLE; clients re-attach by request_id.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from common.pb.quadriga.v1 import generation_pb2, generation_pb2_grpc, replica_pb2, replica_pb2_grpc
from common.tokenizer import max_model_len, vocab_size
from router.admission import Admission
from router.auth import ApiKeyInterceptor, server_credentials
from router.config import RouterConfig
from router.liveness import RouterLease
from router.frontends.grpc_api import GENERATE_METHOD, GenerationService
from router.malformed import CheckedServer
from router.metrics import Metrics
from router.persistence.store import Store
from router.persistence.writer import RedisWriter
from router.events import EventReader
from router.prefix.index import PrefixIndex
from router.prefix.matcher import PrefixMatcher
from router.reaper import Reaper
from router.replicas.gateway import CONNECT_METHOD, ReplicaGateway
from router.replicas.ops import ReplicaOps
from router.replicas.registry import Registry
from router.requests.table import RequestTable
from router.scheduling.policies import PolicySettings
from router.scheduling.pull import PullScheduler
from router.validation import ModelLimits

log = logging.getLogger(__name__)

# Seconds a step of a stop may take (beyond its own bound, where it has one) before the
# stop goes on without it: a stop must end, or a rollout waits for the SIGKILL.
STEP_DEADLINE = 3.0

# Seconds the event loop's teardown may take after a finished stop (it cancels what
# tasks are left and joins the default executor) before the process exits anyway.
TEARDOWN_DEADLINE = 5.0


def exit_if_teardown_hangs(seconds: float) -> None:
    """The stop is done: every write durable, every stream ended. Should what follows
    it (the event loop's teardown) hang, the process exits anyway, with 0."""
    def expire() -> None:
        log.error("the event loop's teardown took over %g s after the stop; exiting", seconds)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


async def _bounded(step: str, awaitable, seconds: float | None = None) -> None:
    seconds = STEP_DEADLINE if seconds is None else seconds
    try:
        await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        log.error("stopping: the %s did not stop within %g s; going on without it", step, seconds)
    except Exception:
        log.exception("stopping: the %s failed; going on", step)


SERVICE_NAMES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    replica_pb2.DESCRIPTOR.services_by_name["ReplicaGateway"].full_name,
)
SHUTDOWN_MESSAGE = ("the router is restarting; nothing was cancelled: call again with the same "
                    "request_id to re-attach")
FENCED_MESSAGE = ("the router lost its Redis lease and starts over; nothing was cancelled: call "
                  "again with the same request_id to re-attach")


class RouterApp:
    """The whole router in the current event loop: start(), then stop()."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = Metrics()
        self.limits = ModelLimits(max_model_len=max_model_len(config.model),
                                  vocab_size=vocab_size(config.model))
        self.store = Store(config.redis_url, config.redis_prefix, config.result_ttl,
                           config.redis_timeout)
        self.writer = RedisWriter(self.store.lean, max_pending_submits=config.max_pending_submits,
                                  stall_after=config.stall_after,
                                  max_in_flight=config.redis_max_in_flight,
                                  linger=config.redis_step_linger_ms / 1000,
                                  reply_timeout=config.submit_timeout, on_stall=self._on_stall)
        self.table = RequestTable(self.store, self.writer, self.metrics, lease_ttl=config.lease_ttl,
                                  max_requeues=config.max_requeues,
                                  show_output=config.show_output)
        self.metrics.watch_table(self.table)
        self.registry = Registry()
        self.prefix_index = PrefixIndex(config.prefix_index_max_entries)
        prefix = PrefixMatcher(self.prefix_index, self.metrics, config.prefix_metrics == "all")
        self.scheduler = PullScheduler(self.table, self.store, self.writer, config.policy,
                                       config.lease_ttl, prefix, PolicySettings.from_config(config),
                                       self.metrics, bool(config.take_at_arrival))
        self.ops = ReplicaOps(self.table, self.scheduler, self.registry, self.metrics,
                              self.limits.vocab_size, config.lease_ttl, self.store, self.writer,
                              self.prefix_index)
        self.admission = Admission(config, self.limits, self.table, self.scheduler, self.registry,
                                   self.writer, self.store, self.metrics)
        self.reaper = Reaper(self.table, self.ops, self.registry, self.writer, self.store,
                             self.metrics, config, self.scheduler)
        self.lease = RouterLease(self.store, self.writer, config.router_lease_ttl,
                                 config.heartbeat_interval, lambda: len(self.registry))
        self.admission.replicas_elsewhere = lambda: self.lease.remote_replicas
        self.scheduler.alone = lambda: self.lease.alone
        self.fenced = asyncio.Event()
        self.writer.on_fenced = lambda reason: self.fenced.set()
        self.table.on_queued = self.scheduler.work_arrived
        self.table.on_cancel_running = self._cancel_on_replica
        self.table.on_release_running = self._release_on_replica
        self.events: EventReader | None = None   # once the lease names this router
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_http = None
        self.http = None        # the OpenAI HTTP front door, when http_port is set
        self.http_port = 0

    def _cancel_on_replica(self, owner: str, rid: str) -> None:
        if self.scheduler.release_held(rid):
            return   # held for its submit's reply: its replica never heard of it
        session = self.registry.get(owner)
        if session is not None:
            session.send_cancel([rid])

    def _release_on_replica(self, owner: str, rid: str) -> None:
        session = self.registry.get(owner)
        if session is not None:
            session.remember_released(rid)

    def _on_stall(self, stalled: bool) -> None:
        self.metrics.redis_stalled.set(1 if stalled else 0)
        self.table.on_stall(stalled)

    @property
    def stopping(self) -> bool:
        return self.admission.stopping

    async def start(self) -> int:
        self.admission.start()
        await self.store.ping()
        await self.lease.acquire()
        self.writer.start()
        self.lease.start()
        self.events = EventReader(self.store, self.table, self.scheduler, self.lease.router_id,
                                  self.config.redis_timeout)
        self.table.on_reload = self.events.reload
        self.store.lean.on_reconnect = self.events.check_after_outage
        self.events.start()
        self.scheduler.start()
        keys = self.config.api_key_set
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(keys)] if keys else None,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                # Replicas ping every few seconds to notice a frozen router.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
            ])
        # Every service gets deserializers that never raise (router/malformed.py).
        checked = CheckedServer(self.server, frozenset({GENERATE_METHOD, CONNECT_METHOD}))
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationService(self.admission, self.table, self.config, self.metrics), checked)
        replica_pb2_grpc.add_ReplicaGatewayServicer_to_server(
            ReplicaGateway(self.ops, self.config, self.metrics, self), checked)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, checked)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME)), checked)
        self.port = self._listen()
        await self.server.start()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port:
            self.metrics_http = self.metrics.serve(self.config.metrics_port)
        if self.config.http_port:
            from router.frontends.openai_http import OpenAIFrontend

            self.http = OpenAIFrontend(self.admission, self.table, self.config, self.metrics,
                                       self.limits)
            self.http_port = await self.http.start(self.config.http_host or self.config.host,
                                                   self.config.http_port)
            self.admission.prepare_chat()
        self.reaper.start()
        log.info("router listening on port %d%s (policy %s, model %s, %s, %s)", self.port,
                 f", HTTP on {self.http_port}" if self.http_port else "",
                 self.config.policy, self.config.served_model_name,
                 "TLS" if self.config.tls_cert_file else "plaintext",
                 f"{len(keys)} API keys" if keys else "no API keys")
        return self.port

    def _listen(self) -> int:
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert_file:
            creds = server_credentials(self.config.tls_cert_file, self.config.tls_key_file)
            port = self.server.add_secure_port(address, creds)
        else:
            port = self.server.add_insecure_port(address)
        if port == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{self.config.port}")
        return port

    async def stop(self, grace: float = 1.0) -> None:
        """The graceful stop described above; cancels no request. Each step has a
        deadline (_bounded): one that overruns is logged by name and the stop goes
        on, so a SIGTERM always ends the process, after the writes were drained."""
        self.admission.stopping = True
        await _bounded("health status", self.health.enter_graceful_shutdown())
        # The scheduler waits up to a lease for a pop in flight, whose Assign must go out.
        await _bounded("scheduler", self.scheduler.stop(), self.config.lease_ttl + STEP_DEADLINE)
        await _bounded("reaper", self.reaper.stop())
        for session in list(self.registry.sessions.values()):
            session.close(grpc.StatusCode.UNAVAILABLE, "the router is restarting; keep your work "
                                                       "and re-register")
        if not await self.writer.drain(self.config.shutdown_timeout):
            log.warning("%d writes were not durable within %g s; replicas still hold their "
                        "output", self.writer.pending, self.config.shutdown_timeout)
        self.table.detach_clients(SHUTDOWN_MESSAGE)
        await _bounded("event reader", self._stop_events())
        await asyncio.sleep(0)  # let the client streams see it before the server cancels them
        if self.http is not None:
            await _bounded("HTTP server", self.http.stop())
        if self.server is not None:
            await _bounded("gRPC server", self.server.stop(grace), grace + STEP_DEADLINE)
        await _bounded("Redis writer", self.writer.stop())
        await _bounded("router lease", self.lease.release())   # else it lapses by itself
        await _bounded("Redis connections", self._close())

    async def abandon(self) -> None:
        """Fenced: another router may own what this one held, so it writes nothing
        more, ends every stream (clients re-attach, replicas reconnect) and closes."""
        self.admission.stopping = True
        self.table.stopping = True
        await _bounded("router lease", self.lease.stop())
        for session in list(self.registry.sessions.values()):
            session.close(grpc.StatusCode.UNAVAILABLE, "the router lost its Redis lease; reconnect")
        self.table.detach_clients(FENCED_MESSAGE)
        await asyncio.sleep(0)
        # Streams end first, so clients and replicas move on while the rest stops.
        if self.http is not None:
            await _bounded("HTTP server", self.http.stop())
        if self.server is not None:
            await _bounded("gRPC server", self.server.stop(0))
        await _bounded("scheduler", self.scheduler.stop(), self.config.lease_ttl + STEP_DEADLINE)
        await _bounded("reaper", self.reaper.stop())
        await _bounded("event reader", self._stop_events())
        await _bounded("Redis writer", self.writer.stop())
        await _bounded("Redis connections", self._close())

    async def _stop_events(self) -> None:
        if self.events is not None:
            await self.events.stop()

    async def _close(self) -> None:
        await self.store.close()
        self.admission.stop()
        if self.metrics_http is not None:
            server, _thread = self.metrics_http
            server.shutdown()
            server.server_close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def freeze_heap() -> None:
    """Takes every object alive now out of the garbage collector's view (gc.freeze).
    serve() calls it once a router has started and after each tokenizer load;
    routers built inside a test process leave that process's heap alone.

    A full collection walks every tracked object, and a started router holds
    about 340 thousand (its modules, grpc, FastAPI, transformers): about 210 ms
    a collection on a 2-core machine, a stall of the loop whenever Python runs
    one, against the objects made since once they are frozen
    (benchmarks/results/router_gc_pause.json). Frozen objects are still freed by
    their reference counts; only cycles among them stay, so a router that starts
    over (fenced) unfreezes the old one's first."""
    gc.freeze()


async def serve(config: RouterConfig) -> None:
    """Runs the router until SIGTERM or SIGINT; a router that was fenced (it lost
    its lease, say while frozen) abandons its state and starts over."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while True:
        app = RouterApp(config)
        app.metrics.watch_process()
        await app.start()
        app.admission.on_loaded = freeze_heap
        freeze_heap()
        stopping = asyncio.ensure_future(stop.wait())
        fenced = asyncio.ensure_future(app.fenced.wait())
        await asyncio.wait([stopping, fenced], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        fenced.cancel()
        if stop.is_set():
            log.info("shutting down: streams end, nothing is cancelled")
            await app.stop()
            log.info("stopped")
            exit_if_teardown_hangs(TEARDOWN_DEADLINE)
            return
        log.error("fenced: starting over as a new router")
        await app.abandon()
        gc.unfreeze()   # the abandoned router's cycles may be collected now

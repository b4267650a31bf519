"""Builds and runs the router: grpc.aio server with the client API, the replica
gateway, health and reflection, plus the Prometheus HTTP endpoint."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.pb.quadriga.v1 import generation_pb2, generation_pb2_grpc, replica_pb2, replica_pb2_grpc
from common.tokenizer import max_model_len, vocab_size
from router.auth import ApiKeyInterceptor, server_credentials
from router.client_api import GenerationService
from router.config import RouterConfig
from router.core import RouterCore
from router.metrics import Metrics
from router.recovery import Reaper, recover
from router.replica_gateway import ReplicaGateway
from router.replica_ops import ReplicaOps
from router.validation import ModelLimits

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
    replica_pb2.DESCRIPTOR.services_by_name["ReplicaGateway"].full_name,
)


class RouterApp:
    """The whole router in the current event loop: start(), then stop()."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = Metrics()
        limits = ModelLimits(max_model_len=max_model_len(config.model),
                             vocab_size=vocab_size(config.model))
        self.core = RouterCore(config, limits, self.metrics)
        self.ops = ReplicaOps(self.core)
        self.reaper = Reaper(self.core, self.ops)
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.metrics_http = None

    async def start(self) -> int:
        await self.core.start()
        await recover(self.core)
        keys = self.config.api_key_set
        self.server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(keys)] if keys else None,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1),
            ])
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(self.core), self.server)
        replica_pb2_grpc.add_ReplicaGatewayServicer_to_server(
            ReplicaGateway(self.core, self.ops), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert_file:
            creds = server_credentials(self.config.tls_cert_file, self.config.tls_key_file)
            self.port = self.server.add_secure_port(address, creds)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{self.config.port}")
        await self.server.start()
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port:
            self.metrics_http = self.metrics.serve(self.config.metrics_port)
        self.reaper.start()
        log.info("router listening on port %d (policy %s, model %s, %s, %s)", self.port,
                 self.config.policy, self.config.served_model_name,
                 "TLS" if self.config.tls_cert_file else "plaintext",
                 f"{len(keys)} API keys" if keys else "no API keys")
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.reaper.stop()
        for session in list(self.core.registry.sessions.values()):
            session.close(None)
        if self.server is not None:
            await self.server.stop(grace)
        await self.core.stop()
        if self.metrics_http is not None:
            server, thread = self.metrics_http
            server.shutdown()
            server.server_close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def serve(config: RouterConfig) -> None:
    app = RouterApp(config)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await app.stop()

"""API keys and TLS on the router's gRPC port, over real gRPC."""

import asyncio
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.api import aio_channel, make_request, metadata
from common.pb.quadriga.v1 import generation_pb2_grpc
from tests.support.router_harness import Replicas, make_config, running_router


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


async def generate(stub, md=(), n=4):
    tokens = []
    async for msg in stub.Generate(make_request([5, 6, 7], max_tokens=n), metadata=md, timeout=20):
        tokens.extend(msg.token_ids)
    return tokens


def test_api_keys_guard_generation_but_not_health(arun, redis_url, tiny_model):
    async def scenario():
        config = make_config(redis_url, tiny_model, api_keys="key-one, key-two")
        async with running_router(config) as app:
            replicas = Replicas(app.address, vocab=512)
            await replicas.add("r0")
            async with aio_channel(app.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for md, why in (((), "missing"), (metadata("wrong"), "invalid")):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await generate(stub, md)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert why in err.value.details()
                assert len(await generate(stub, metadata("key-two"))) == 4
                assert len(await generate(stub, (("x-api-key", "key-one"),))) == 4
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await replicas.close()

    arun(scenario())


def test_tls_serves_trusting_clients_and_a_real_worker(arun, redis_url, tiny_model, tls_files):
    from replica_worker.worker.app import build_worker
    from replica_worker.worker.config import parse_args

    cert, key = tls_files

    async def scenario():
        config = make_config(redis_url, tiny_model, tls_cert_file=cert, tls_key_file=key)
        async with running_router(config) as app:
            target = f"localhost:{app.port}"
            # Built off the loop: loading the tokenizer and starting the engine process
            # take seconds, and the router on this loop must keep renewing its lease.
            worker = await asyncio.to_thread(build_worker, parse_args([
                "--router", target, "--model", str(tiny_model), "--replica-id", "tls-replica",
                "--tls-ca-file", cert, "--num-blocks", "64"]))
            task = asyncio.create_task(worker.run())
            try:
                async with aio_channel(target, ca_file=cert) as channel:
                    stub = generation_pb2_grpc.GenerationStub(channel)
                    assert len(await generate(stub, n=6)) == 6
                async with grpc.aio.insecure_channel(target) as plain:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await generate(generation_pb2_grpc.GenerationStub(plain))
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                worker.begin_drain()
                await asyncio.wait_for(task, 20)

    arun(scenario(), timeout=90)


def test_secrets_stay_out_of_the_config_repr(redis_url, tiny_model):
    config = make_config(redis_url, tiny_model, api_keys="sekrit", replica_token="hush")
    assert "sekrit" not in repr(config) and "hush" not in repr(config)

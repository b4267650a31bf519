"""The router reaches Redis over TLS with a password, both taken from a rediss:// URL."""

import shutil
import subprocess
import time

import pytest
import redis

from common.redis_server import free_port
from tests.support.router_harness import Replicas, client, collect, make_config, request, running_router, tokens_of
from tests.support.scripted_replica import expected_tokens


@pytest.fixture(scope="module")
def tls_redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs Debian's redis-server (built with TLS): apt-get install -y redis-server")
    d = tmp_path_factory.mktemp("redis-tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
         "--tls-auth-clients", "no", "--requirepass", "s3cret", "--save", "", "--dir", str(d)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"rediss://:s3cret@localhost:{port}/0?ssl_ca_certs={cert}"
    for _ in range(100):
        try:
            if redis.from_url(url, socket_timeout=0.5).ping():
                break
        except redis.RedisError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("TLS redis-server did not answer")
    yield url
    proc.terminate()
    proc.wait(5)


def test_router_serves_through_tls_redis_with_password(arun, tls_redis_url, tiny_model):
    async def scenario():
        async with running_router(make_config(tls_redis_url, tiny_model)) as app:
            replicas = Replicas(app.address, vocab=512)
            await replicas.add("r0")
            async with client(app.address) as stub:
                msgs = await collect(stub, request([3, 4, 5], 6))
            await replicas.close()
            return tokens_of(msgs)

    assert arun(scenario()) == expected_tokens([3, 4, 5], 6, 512)

"""Asks a gRPC server's grpc.health.v1 service whether it is SERVING.

    python docker/grpc_health_probe.py --addr localhost:50051 [--service NAME]
        [--timeout 3] [--tls-ca-file CA.pem] [--tls-server-name NAME]

Exit 0: SERVING. Exit 1: answered, but not SERVING (for example while the
router shuts down). Exit 2: no answer (refused, timed out, TLS failure).
Used as the router image's HEALTHCHECK and as an exec probe where Kubernetes'
native gRPC probe cannot be used (it speaks plaintext only).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", timeout: float = 3.0, tls_ca_file: str = "",
          tls_server_name: str = "") -> str:
    """Returns the status name (SERVING, NOT_SERVING, ...); raises grpc.RpcError on no answer."""
    if tls_ca_file:
        with open(tls_ca_file, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        channel = grpc.secure_channel(addr, creds, options=options)
    else:
        channel = grpc.insecure_channel(addr)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", default="localhost:50051", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name; empty: the whole server")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tls-ca-file", default="", help="dial with TLS, trusting this CA bundle")
    p.add_argument("--tls-server-name", default="", help="name to verify the certificate against")
    a = p.parse_args(argv)
    try:
        status = check(a.addr, a.service, a.timeout, a.tls_ca_file, a.tls_server_name)
    except grpc.RpcError as exc:
        print(f"{a.addr}: no answer: {exc.code().name}", file=sys.stderr)
        return 2
    except OSError as exc:  # unreadable CA file
        print(f"{a.addr}: {exc}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())

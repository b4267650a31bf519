"""Client API keys and TLS for the router's gRPC port.

Clients of the Generation service present a key as gRPC metadata
`authorization: Bearer <key>` or `x-api-key: <key>`. Health and reflection
stay open so probes work; replicas authenticate with the shared replica
token inside Register instead.
"""

from __future__ import annotations

import hmac

import grpc

PROTECTED_PREFIX = "/quadriga.v1.Generation/"


def presented_key(metadata) -> str:
    for key, value in metadata or ():
        if key == "x-api-key":
            return value
        if key == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return ""


def key_matches(candidate: str, keys: frozenset[str]) -> bool:
    # Compare against every key in constant time, so timing reveals nothing.
    found = False
    for key in keys:
        found |= hmac.compare_digest(candidate.encode(), key.encode())
    return found


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: frozenset[str]):
        self._keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        key = presented_key(details.invocation_metadata)
        if not key:
            return _denying(handler, "missing API key: send metadata 'authorization: Bearer <key>'")
        if not key_matches(key, self._keys):
            return _denying(handler, "invalid API key")
        return handler


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    with open(cert_file, "rb") as f:
        cert = f.read()
    with open(key_file, "rb") as f:
        key = f.read()
    return grpc.ssl_server_credentials([(key, cert)])

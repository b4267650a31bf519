"""Malformed bytes on any RPC: INVALID_ARGUMENT with a message, and one log line.

gRPC deserializes each request with the service's `FromString`; bytes that do
not parse raise inside gRPC itself, which answers UNKNOWN and logs a traceback
per call. `CheckedServer` gives every method a deserializer that never
raises: a bad message becomes a `Malformed` value, and the method's handler
answers it (unary requests) or its stream raises MalformedMessage where the
message would have been (streaming requests).

The handlers are wrapped once, as the services are added to the server, not
per call by a server interceptor: an interceptor costs every RPC a chain of
coroutines, and Generate is the router's per-request path.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)


class Malformed:
    __slots__ = ("method", "error")

    def __init__(self, method: str, error: Exception):
        self.method = method
        self.error = error

    def describe(self) -> str:
        return f"the {self.method.rsplit('/', 1)[-1]} request is not a valid protobuf message " \
               f"({type(self.error).__name__}: {self.error})"


class MalformedMessage(Exception):
    """Raised from a request stream at a message that did not parse."""


def _safe(method: str, deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a custom parser raises
            log.warning("malformed message on %s: %s", method, exc)
            return Malformed(method, exc)
    return parse


def check_message(msg):
    """msg itself, or MalformedMessage raised for one that did not parse."""
    if isinstance(msg, Malformed):
        raise MalformedMessage(msg.describe())
    return msg


async def _checked_stream(iterator):
    async for msg in iterator:
        yield check_message(msg)


def _wrap(method: str, handler: grpc.RpcMethodHandler, checks_itself: bool) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler
    parse = _safe(method, deserialize)
    serialize = handler.response_serializer
    if handler.request_streaming:
        if handler.response_streaming and checks_itself:
            # The replica stream: its reader raises MalformedMessage itself (check_message).
            return grpc.stream_stream_rpc_method_handler(handler.stream_stream, request_deserializer=parse,
                                                         response_serializer=serialize)
        if handler.response_streaming:
            inner_ss = handler.stream_stream

            async def stream_stream(request_iterator, context):
                async for msg in inner_ss(_checked_stream(request_iterator), context):
                    yield msg

            return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=parse,
                                                         response_serializer=serialize)
        inner_su = handler.stream_unary

        async def stream_unary(request_iterator, context):
            return await inner_su(_checked_stream(request_iterator), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=parse,
                                                    response_serializer=serialize)
    if handler.response_streaming:
        inner_us = handler.unary_stream
        if checks_itself:
            # The per-token path: no extra generator layer; the servicer answers Malformed.
            return grpc.unary_stream_rpc_method_handler(inner_us, request_deserializer=parse,
                                                        response_serializer=serialize)

        async def unary_stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
            async for msg in inner_us(request, context):
                yield msg

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse,
                                                    response_serializer=serialize)
    inner_uu = handler.unary_unary

    async def unary(request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return await inner_uu(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=parse,
                                               response_serializer=serialize)


class _CheckedGeneric(grpc.GenericRpcHandler):
    """A service's generic handler, answering with wrapped handlers (made once per method)."""

    def __init__(self, inner: grpc.GenericRpcHandler, checked: frozenset[str]):
        self._inner = inner
        self._checked = checked
        # Only methods the service has: a client naming arbitrary methods must
        # not grow this (unknown ones are looked up each time and answered
        # UNIMPLEMENTED by gRPC).
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, handler_call_details):
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            handler = self._inner.service(handler_call_details)
            if handler is None:
                return None
            wrapped = self._wrapped[method] = _wrap(method, handler, method in self._checked)
        return wrapped


class CheckedServer:
    """What the generated add_*Servicer_to_server functions are given instead of
    the server: they register the service's handlers through it, wrapped.

    checked_by_servicer: methods whose servicer answers a Malformed request
    itself (hot paths, where a wrapping generator would cost every message)."""

    def __init__(self, server, checked_by_servicer: frozenset[str] = frozenset()):
        self._server = server
        self._checked = checked_by_servicer

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(_CheckedGeneric(h, self._checked) for h in generic_handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, {
            name: _wrap(f"/{service}/{name}", h, f"/{service}/{name}" in self._checked)
            for name, h in handlers.items()})

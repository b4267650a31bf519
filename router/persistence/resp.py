"""A lean Redis connection for the router's writes: one pipelined connection,
hiredis parsing, a deadline on every round trip.

benchmarks/router/redis_client.py measures it against redis-py's own asyncio
Connection with the same hiredis parser, side by side: it costs about half the
CPU per script call (benchmarks/results/redis_client.json), and the router's
event loop is what saturates first, so it stays. What redis-py would have
given it has: connect and call deadlines, AUTH/SELECT, TLS from a rediss://
URL's settings, and scripts loaded on every (re)connect so EVALSHA never
meets NOSCRIPT in the middle of a pipeline.

Replies come back in order on the one connection, so commands sent in order
are applied in order. A lost connection or a missed deadline fails every call
in flight with ConnectionError (or TimeoutError); the next call reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl

import hiredis


class ReplyError(Exception):
    pass


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.failure: type[Exception] = ConnectionError

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader, waiters = self.reader, self.waiters
        reader.feed(data)
        while True:
            reply = reader.gets()
            if reply is False:
                return
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc) -> None:
        self.closed = True
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(self.failure(f"Redis connection lost: {exc or 'closed'}"))

    def abort(self, failure: type[Exception]) -> None:
        self.failure = failure
        if self.transport is not None:
            self.transport.abort()


def tls_context(kw: dict) -> ssl.SSLContext:
    """The TLS settings a rediss:// URL gave redis-py (ssl_cert_reqs, ssl_ca_certs, ...)."""
    ctx = ssl.create_default_context(cafile=kw.get("ssl_ca_certs"), capath=kw.get("ssl_ca_path"))
    if kw.get("ssl_certfile"):
        ctx.load_cert_chain(kw["ssl_certfile"], kw.get("ssl_keyfile"), kw.get("ssl_password"))
    reqs = kw.get("ssl_cert_reqs", "required")
    if reqs in ("none", ssl.CERT_NONE):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ctx.check_hostname = kw.get("ssl_check_hostname", True)
    return ctx


class Script:
    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def command(self, args, numkeys: int = 0) -> tuple:
        """args: the keys (the first numkeys) then the script's ARGV."""
        return ("EVALSHA", self.sha, numkeys, *args)


class LeanRedis:
    def __init__(self, connection_kwargs: dict, tls: bool = False, timeout: float = 5.0):
        self.kw = connection_kwargs
        self.timeout = timeout
        self._tls = tls_context(connection_kwargs) if tls else None
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._scripts: list[Script] = []

    def script(self, text: str) -> Script:
        """A script loaded on every connection before any call is sent on it."""
        script = Script(text)
        self._scripts.append(script)
        return script

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        kw = self.kw
        if kw.get("path"):
            opening = loop.create_unix_connection(_Protocol, kw["path"])
        else:
            host = kw.get("host", "127.0.0.1")
            opening = loop.create_connection(_Protocol, host, kw.get("port", 6379), ssl=self._tls,
                                             server_hostname=host if self._tls else None)
        _, proto = await asyncio.wait_for(opening, self.timeout)
        setup = []
        if kw.get("password"):
            setup.append(("AUTH", *([kw["username"]] if kw.get("username") else []), kw["password"]))
        if kw.get("db"):
            setup.append(("SELECT", kw["db"]))
        setup += [("SCRIPT", "LOAD", s.text) for s in self._scripts]
        try:
            for reply in await self._round_trip(proto, setup):
                if isinstance(reply, hiredis.ReplyError):
                    # LOADING after a restart, a wrong password: the connection is
                    # unusable either way, so it fails as a connection does.
                    raise ConnectionError(f"Redis refused the connection's set-up: {reply}")
        except BaseException:
            proto.abort(ConnectionError)
            raise
        return proto

    async def _conn(self) -> _Protocol:
        proto = self._proto
        if proto is not None and not proto.closed:
            return proto
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            self._proto = await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None
        return self._proto

    def _send(self, proto: _Protocol, commands) -> list[asyncio.Future]:
        """Writes every command at once; one future per reply, in order. One
        timer covers them all: a stalled server fails every call sent with them."""
        loop = asyncio.get_running_loop()
        futures = []
        for _ in commands:
            fut = loop.create_future()
            proto.waiters.append(fut)
            futures.append(fut)
        proto.transport.write(b"".join(hiredis.pack_command(c) for c in commands))
        timer = loop.call_later(self.timeout, proto.abort, TimeoutError)
        futures[-1].add_done_callback(lambda _: timer.cancel())
        for fut in futures:  # they fail together: none is left unretrieved
            fut.add_done_callback(_retrieve)
        return futures

    async def _round_trip(self, proto: _Protocol, commands) -> list:
        """Sends every command in one write and waits for all replies, within the deadline."""
        if not commands:
            return []
        return [await fut for fut in self._send(proto, commands)]

    async def send(self, commands) -> list[asyncio.Future]:
        """Sends now and returns the replies' futures without waiting for them,
        so a caller may send again before they come: the one connection keeps
        the order. A future fails with ConnectionError or TimeoutError."""
        proto = await self._conn()
        return self._send(proto, commands) if commands else []

    async def execute_many(self, commands) -> list:
        """Replies in order; a command's error reply comes back as a ReplyError instance."""
        proto = await self._conn()
        replies = await self._round_trip(proto, commands)
        return [ReplyError(str(r)) if isinstance(r, hiredis.ReplyError) else r for r in replies]

    async def execute(self, *command):
        [reply] = await self.execute_many([command])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    def close(self) -> None:
        if self._proto is not None:
            self._proto.abort(ConnectionError)
        self._proto = None

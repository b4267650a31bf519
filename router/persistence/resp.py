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
from typing import Callable

import hiredis


class ReplyError(Exception):
    pass


class _Batch:
    """The replies of one write of commands: its future gets them all, as a list,
    once the last has come (one future per batch, not per command: this is the
    router's hottest path)."""

    __slots__ = ("expected", "replies", "future", "sent_at")

    def __init__(self, expected: int, future: asyncio.Future, sent_at: float):
        self.expected = expected
        self.replies: list = []
        self.future = future
        self.sent_at = sent_at


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.batches: collections.deque[_Batch] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.failure: type[Exception] = ConnectionError
        self.watchdog: asyncio.TimerHandle | None = None   # LeanRedis._watch: the deadline

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader, batches = self.reader, self.batches
        reader.feed(data)
        while True:
            reply = reader.gets()
            if reply is False:
                return
            batch = batches[0]
            batch.replies.append(reply)
            if len(batch.replies) == batch.expected:
                batches.popleft()
                if not batch.future.done():
                    batch.future.set_result(batch.replies)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        while self.batches:
            fut = self.batches.popleft().future
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
        self.connections = 0
        # Called after every connection but the first: Redis may have restarted.
        self.on_reconnect: Callable[[], None] = lambda: None

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
            fresh = await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None
        if fresh is not self._proto:
            self._proto = fresh
            self.connections += 1
            if self.connections > 1:
                self.on_reconnect()
        return self._proto

    def _send(self, proto: _Protocol, commands) -> asyncio.Future:
        """Writes every command at once; returns the future of their replies (a
        list, in order). A stalled server fails every batch on the connection."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fut.add_done_callback(_retrieve)   # failed together: none is left unretrieved
        proto.batches.append(_Batch(len(commands), fut, loop.time()))
        proto.transport.write(b"".join([hiredis.pack_command(c) for c in commands]))
        self._watch(proto)
        return fut

    def _watch(self, proto: _Protocol) -> None:
        """The deadline: one timer per connection, re-armed lazily for the oldest
        unanswered batch (not one timer per batch, set and cancelled each time)."""
        if proto.watchdog is None:
            proto.watchdog = asyncio.get_running_loop().call_later(self.timeout, self._check, proto)

    def _check(self, proto: _Protocol) -> None:
        proto.watchdog = None
        if proto.closed or not proto.batches:
            return
        late = asyncio.get_running_loop().time() - proto.batches[0].sent_at
        if late >= self.timeout:
            proto.abort(TimeoutError)
        else:
            proto.watchdog = asyncio.get_running_loop().call_later(self.timeout - late,
                                                                   self._check, proto)

    async def _round_trip(self, proto: _Protocol, commands) -> list:
        """Sends every command in one write and waits for all replies, within the deadline."""
        if not commands:
            return []
        return await self._send(proto, commands)

    async def send(self, commands) -> asyncio.Future | None:
        """Sends now and returns the future of the replies (a list, in order)
        without waiting for it, so a caller may send again before it is done: the
        one connection keeps the order. It fails with ConnectionError or
        TimeoutError. None for no commands."""
        proto = await self._conn()
        return self._send(proto, commands) if commands else None

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

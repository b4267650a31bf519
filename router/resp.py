"""A lean Redis client for the router's hot path: one pipelined connection,
hiredis parsing, scripts by EVALSHA (EVAL once after NOSCRIPT).

redis-py's asyncio client spends more CPU per call than the whole rest of a
request's handling (connection pool, retries, per-command hooks). The hot
calls (submit, pop, step writes) are single script calls, so they go through
this instead; everything else keeps using redis-py.

Replies come back in order on the one connection, so calls made in order are
applied in order. A lost connection fails the calls in flight with
ConnectionError and the next call reconnects.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ssl

import hiredis


class ReplyError(Exception):
    pass


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False

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
                fut.set_exception(ConnectionError(f"Redis connection lost: {exc}"))


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


class LeanRedis:
    def __init__(self, connection_kwargs: dict, tls: bool = False):
        self.kw = connection_kwargs
        self._tls = tls_context(connection_kwargs) if tls else None
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        kw = self.kw
        if kw.get("path"):
            _, proto = await loop.create_unix_connection(_Protocol, kw["path"])
        else:
            host = kw.get("host", "127.0.0.1")
            _, proto = await loop.create_connection(
                _Protocol, host, kw.get("port", 6379), ssl=self._tls,
                server_hostname=host if self._tls else None)
        setup = []
        if kw.get("password"):
            setup.append(("AUTH", *([kw["username"]] if kw.get("username") else []), kw["password"]))
        if kw.get("db"):
            setup.append(("SELECT", kw["db"]))
        for cmd in setup:
            reply = await self._send(proto, cmd)
            if isinstance(reply, hiredis.ReplyError):
                proto.transport.close()
                raise ReplyError(str(reply))
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

    @staticmethod
    def _send(proto: _Protocol, cmd) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        proto.waiters.append(fut)
        proto.transport.write(hiredis.pack_command(cmd))
        return fut

    async def execute(self, *cmd):
        proto = self._proto
        if proto is None or proto.closed:
            proto = await self._conn()
        reply = await self._send(proto, cmd)
        if isinstance(reply, hiredis.ReplyError):
            raise ReplyError(str(reply))
        return reply

    def script(self, text: str) -> "LeanScript":
        return LeanScript(self, text)

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None


class LeanScript:
    def __init__(self, client: LeanRedis, text: str):
        self.client = client
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    async def __call__(self, args, numkeys: int = 0) -> object:
        """args: the keys (the first numkeys) then the script's ARGV."""
        try:
            return await self.client.execute("EVALSHA", self.sha, numkeys, *args)
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.client.execute("EVAL", self.text, numkeys, *args)

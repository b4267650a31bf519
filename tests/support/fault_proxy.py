"""A TCP proxy that injects network faults between two real processes.

It runs its own event loop in a thread, so it serves a router in the test's
loop as well as one in a subprocess. Faults:
- drop_reply_after(pattern, skip=0): the client write containing `pattern`
  (after `skip` such writes) is delivered and executed by the server; its
  reply is swallowed and the client's connection closed. A reply lost after
  the server ran the command.
- hold(pattern=None): stop delivering client bytes (from the next write
  containing pattern, or at once) until release(): a server that has stalled.
- reset(): close every connection at once (a network blip); new
  connections are accepted as before.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from common.redis_server import free_port


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._drop: list[list] = []             # [pattern, writes to let pass first], in order
        self._hold_pattern: bytes | None = None
        self._released = None                   # asyncio.Event in the proxy's loop
        self.dropped = 0
        self.held = threading.Event()           # set once a hold took effect

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    async def _start(self) -> None:
        self._released = asyncio.Event()
        self._released.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    def stop(self) -> None:
        self._call(self._close_all)
        self._call(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, fn, *args) -> None:
        async def run():
            fn(*args)
        asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    # ---- faults ----
    def drop_reply_after(self, pattern: bytes, skip: int = 0) -> None:
        self._call(self._drop.append, [pattern, skip])

    def hold(self, pattern: bytes | None = None) -> None:
        def arm():
            if pattern is None:
                self._released.clear()
                self.held.set()
            else:
                self._hold_pattern = pattern
        self._call(arm)

    def release(self) -> None:
        def free():
            self._hold_pattern = None
            self.held.clear()
            self._released.set()
        self._call(free)

    def reset(self) -> None:
        self._call(self._close_all)

    def _close_all(self) -> None:
        for client, server in list(self._conns):
            for w in (client, server):
                sock = w.get_extra_info("socket")
                if sock is not None:  # an RST, as a broken network gives
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                w.close()
        self._conns.clear()

    # ---- forwarding ----
    async def _serve(self, c_reader, c_writer) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        pair = (c_writer, s_writer)
        self._conns.add(pair)
        swallow = asyncio.Event()
        up = asyncio.ensure_future(self._upstream(c_reader, s_writer, swallow))
        down = asyncio.ensure_future(self._downstream(s_reader, c_writer, swallow, pair))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in pair:
            w.close()
        self._conns.discard(pair)

    async def _upstream(self, reader, writer, swallow: asyncio.Event) -> None:
        while data := await reader.read(65536):
            if self._hold_pattern is not None and self._hold_pattern in data:
                self._hold_pattern = None
                self._released.clear()
                self.held.set()
            await self._released.wait()
            if self._drop and self._drop[0][0] in data:
                if self._drop[0][1] == 0:
                    self._drop.pop(0)
                    swallow.set()
                else:
                    self._drop[0][1] -= 1
            writer.write(data)
            await writer.drain()

    async def _downstream(self, reader, writer, swallow: asyncio.Event, pair) -> None:
        while data := await reader.read(65536):
            if swallow.is_set():
                # The server ran what it was sent; let it finish the rest of the
                # batch, then the client loses every reply and its connection.
                await asyncio.sleep(0.02)
                self.dropped += 1
                return
            writer.write(data)
            await writer.drain()

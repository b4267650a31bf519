"""Redis data model: the truth about accepted work, so a router restart loses nothing.

Keys (prefix P, default "quadriga:"):
  P req:<id>     hash   a=Assignment bytes (prompt ids, sampling, arrival), d=digest,
                        pl, mt, pr, si, m=queue member, q=queue name, st=q|r|f,
                        o=owner replica, seq, rq=requeues, asg, fs, ft, fin, fr, err, rep, pre
  P out:<id>     string output token ids so far, packed little-endian uint32
  P txt:<id>     string output text so far
  P q:<name>     zset   queued requests; name is "pending" or "r:<replica>";
                        score = -priority, member = arrival_us(16) seq(12) ":" id,
                        so equal priorities pop in arrival order
  P inflight     zset   running request ids, score = lease expiry (unix s)
  P seq          counter (INCR) breaking arrival ties
Finished requests keep req/out/txt for result_ttl seconds.
"""

from __future__ import annotations

import array
import asyncio
import math
import sys

import redis.asyncio as aioredis

from router import lua
from router.resp import LeanRedis

_LITTLE = sys.byteorder == "little"


def pack_tokens(token_ids) -> bytes:
    a = array.array("I", token_ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_tokens(data: bytes | None) -> list[int]:
    if not data:
        return []
    a = array.array("I")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


class GroupCommit:
    """Group commit: the calls made in one event-loop tick, and those made while
    a flush is in flight, share one flush (one Redis round trip). Flushes run
    one at a time and in order, so writes land in the order they were made.
    `flush(items)` returns one result per item."""

    def __init__(self, flush):
        self._flush = flush
        self._items: list = []
        self._waiters: list[asyncio.Future] = []
        self._task: asyncio.Task | None = None

    async def __call__(self, item):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._items.append(item)
        self._waiters.append(fut)
        if self._task is None:
            self._task = loop.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        try:
            while self._waiters:
                items, waiters = self._items, self._waiters
                self._items, self._waiters = [], []
                try:
                    results = await self._flush(items)
                except Exception as exc:
                    for fut in waiters:
                        if not fut.done():
                            fut.set_exception(exc)
                except BaseException:
                    for fut in waiters:
                        if not fut.done():
                            fut.set_exception(ConnectionError("Redis write interrupted"))
                    raise
                else:
                    for fut, result in zip(waiters, results):
                        if not fut.done():
                            fut.set_result(result)
        finally:
            self._task = None


class Store:
    def __init__(self, url: str, prefix: str, result_ttl: float):
        self.redis = aioredis.from_url(url, decode_responses=False)
        self.prefix = prefix
        self.ttl = max(1, math.ceil(result_ttl))
        self.round_trips = 0
        self._requeue = self.redis.register_script(lua.REQUEUE)
        self._move = self.redis.register_script(lua.MOVE)
        self._cancel_queued = self.redis.register_script(lua.CANCEL_QUEUED)
        self._sync = self.redis.register_script(lua.SYNC)
        # Hot-path scripts (submit, pop, step writes) go over one lean connection.
        pool = self.redis.connection_pool
        self.lean = LeanRedis(pool.connection_kwargs,
                              tls=issubclass(pool.connection_class, aioredis.SSLConnection))
        self._submit_many = self.lean.script(lua.SUBMIT_MANY)
        self._pop = self.lean.script(lua.POP)
        self._step = self.lean.script(lua.STEP)
        self._steps = GroupCommit(self._flush_steps)
        self._submits = GroupCommit(self._flush_submits)

    # ---- keys ----
    def req_key(self, rid: str) -> str:
        return f"{self.prefix}req:{rid}"

    def out_key(self, rid: str) -> str:
        return f"{self.prefix}out:{rid}"

    def txt_key(self, rid: str) -> str:
        return f"{self.prefix}txt:{rid}"

    def queue_key(self, name: str) -> str:
        return f"{self.prefix}q:{name}"

    @property
    def inflight_key(self) -> str:
        return f"{self.prefix}inflight"

    async def ping(self) -> None:
        self.round_trips += 1
        await self.redis.ping()

    async def close(self) -> None:
        self.lean.close()
        await self.redis.aclose()

    # ---- transitions (one round trip each) ----
    async def submit(self, rid: str, digest: str, assignment: bytes, prompt_len: int,
                     max_tokens: int, priority: int, arrival: float, stream_interval: int,
                     queue: str) -> tuple[bool, str, str]:
        """(created, member, "") or (False, existing digest, existing state).

        Submits of one event-loop tick share one SUBMIT_MANY call."""
        return await self._submits((rid, digest, assignment, prompt_len, max_tokens, priority,
                                    repr(arrival), int(arrival * 1e6), stream_interval, queue))

    async def _flush_submits(self, items: list[tuple]) -> list[tuple[bool, str, str]]:
        args = [self.prefix]
        for item in items:
            args += item
        self.round_trips += 1
        res = await self._submit_many(args)
        out = []
        for i in range(0, len(res), 3):
            if int(res[i]) == 1:
                out.append((True, res[i + 1].decode(), ""))
            else:
                out.append((False, res[i + 1].decode(), res[i + 2].decode()))
        return out

    async def pop(self, queue: str, replica: str, max_requests: int, max_prompt_tokens: int | None,
                  lease_expiry: float, now: float) -> list[str]:
        """Takes from the head while token credit is left (None: no token limit; see lua.POP)."""
        self.round_trips += 1
        tokens = -1 if max_prompt_tokens is None else max(0, max_prompt_tokens)
        res = await self._pop([self.queue_key(queue), self.inflight_key, self.prefix, replica,
                               max_requests, tokens, repr(lease_expiry), repr(now)], numkeys=2)
        return [r.decode() for r in res]

    async def requeue(self, items: list[tuple[str, str]], owner: str = "") -> list[bool]:
        if not items:
            return []
        self.round_trips += 1
        args = [self.prefix, owner]
        for rid, queue in items:
            args += [rid, queue]
        return [bool(int(x)) for x in await self._requeue(args=args)]

    async def move(self, items: list[tuple[str, str]]) -> list[bool]:
        if not items:
            return []
        self.round_trips += 1
        args = [self.prefix]
        for rid, queue in items:
            args += [rid, queue]
        return [bool(int(x)) for x in await self._move(args=args)]

    async def cancel_queued(self, rid: str, now: float, reason: int, error: str) -> bool:
        self.round_trips += 1
        res = await self._cancel_queued(args=[self.prefix, rid, repr(now), self.ttl, reason, error])
        return bool(int(res))

    async def sync(self, items: list[tuple], lease_expiry: float) -> None:
        """Rewrites records from memory: (id, state, queue, owner, tokens or None,
        text, fields) each; tokens None leaves the output keys alone."""
        if not items:
            return
        args = [self.prefix, self.ttl, repr(lease_expiry)]
        for rid, state, queue, owner, tokens, text, fields in items:
            args += [rid, state, queue, owner, 0 if tokens is None else 1,
                     pack_tokens(tokens) if tokens else b"", text.encode(), len(fields)]
            for k, v in fields.items():
                args += [k, v]
        self.round_trips += 1
        await self._sync(args=args)

    # ---- pipelined writes ----
    def pipeline(self):
        return self.redis.pipeline(transaction=False)

    async def execute(self, pipe) -> None:
        self.round_trips += 1
        await pipe.execute()

    def add_finish(self, pipe, rid: str, fields: dict) -> None:
        pipe.hset(self.req_key(rid), mapping={**fields, "st": "f", "q": "", "o": ""})
        pipe.zrem(self.inflight_key, rid)
        for key in (self.req_key(rid), self.out_key(rid), self.txt_key(rid)):
            pipe.expire(key, self.ttl)

    # ---- step writes ----
    async def write_steps(self, args: list) -> None:
        """Records step deltas (12 STEP arguments each, see lua.STEP); returns once
        durable. All StepOutputs of one event-loop tick share one call."""
        await self._steps(args)

    async def _flush_steps(self, batches: list[list]) -> list:
        args = [self.prefix, self.ttl]
        for batch in batches:
            args += batch
        self.round_trips += 1
        await self._step(args)
        return [None] * len(batches)

    async def renew_leases(self, leases: dict[str, float]) -> None:
        if leases:
            self.round_trips += 1
            await self.redis.zadd(self.inflight_key, leases, xx=True)

    # ---- reads (recovery and re-attach after a finish) ----
    async def load_requests(self, ids: list[str]) -> list[dict | None]:
        out: list[dict | None] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            pipe = self.pipeline()
            for rid in chunk:
                pipe.hgetall(self.req_key(rid))
                pipe.get(self.out_key(rid))
                pipe.get(self.txt_key(rid))
            self.round_trips += 1
            res = await pipe.execute()
            for i, rid in enumerate(chunk):
                h, toks, txt = res[3 * i], res[3 * i + 1], res[3 * i + 2]
                if not h:
                    out.append(None)
                    continue
                rec = {k.decode(): v for k, v in h.items()}
                rec["id"] = rid
                rec["tokens"] = unpack_tokens(toks)
                rec["text"] = (txt or b"").decode(errors="replace")
                out.append(rec)
        return out

    async def live_ids(self) -> tuple[dict[str, str], dict[str, float]]:
        """({queued id: queue name}, {in-flight id: lease expiry})."""
        queued: dict[str, str] = {}
        pattern = self.queue_key("*")
        async for key in self.redis.scan_iter(match=pattern, count=500):
            name = key.decode()[len(self.queue_key("")):]
            for member in await self.redis.zrange(key, 0, -1):
                queued[member.decode()[29:]] = name
        inflight = {m.decode(): s for m, s in
                    await self.redis.zrange(self.inflight_key, 0, -1, withscores=True)}
        return queued, inflight

"""Redis data model: the truth about accepted work, so a router restart loses nothing.

Keys (prefix P, default "quadriga:"):
  P req:<id>     hash   sp=spec json (sampling; prompt text not kept), p=prompt ids
                        (packed), d=digest, tok=submit token, pl, mt, pr, si, at=arrival,
                        m=queue member, q=queue name, st=q|r|f, o=owner replica,
                        n=times assigned, seq, rq=requeues, asg, fs, ft, fin, fr, err, rep, pre
  P out:<id>     string output token ids so far, packed little-endian uint32
  P txt:<id>     string output text so far (UTF-8)
  P lp:<id>      string with sampling.logprobs = k: per output token, its logprob and
                        the top k (id, logprob), packed (pack_logprobs); 4 + 8k bytes a token
  P q:<name>     zset   queued requests; name is "pending" or "r:<replica>";
                        score = -priority, member = arrival_us(16) seq(12) ":" id,
                        so equal priorities pop in arrival order
  P inflight     zset   running request ids, score = lease expiry (unix s)
  P live         set    every unfinished request id
  P seq          counter (INCR) breaking arrival ties
  P pop:<token>  string the ids one pop took (msgpack), for 300 s (a retried pop
                        returns them again)
  P routers      zset   live routers, score = lease expiry (Redis TIME, unix s)
  P router:<id>  hash   epoch, started, nrep (its replicas), r:<replica> (its replicas' own queues)
  P fence:<id>   string the router's epoch, expiring with its lease: fences its writes
                        (lua_common.FENCE)
  P epoch        counter (INCR) a router's epoch at registration
  P ev:<id>      stream events for router <id> (router/events.py), MAXLEN ~100000
  P ao           counter (INCR) assignment ordinal: the global order of pops
A request hash also holds fe (its front routers, space-separated), br (its back
router while running), ao (its last assignment's ordinal), and the Redis
times it was stored (sat) and last popped (pat).
Finished requests keep req/out/txt for result_ttl seconds.

Every write is built here as a `Write` and goes through the RedisWriter
(writer.py), in order; reads (a reload, a popped request's output) use
redis-py with the same deadline.
"""

from __future__ import annotations

import array
import math
import struct
import sys
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from router.persistence import lua, lua_routers
from router.persistence.resp import LeanRedis
from router.persistence.writer import Write

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


_NO_TOKEN = 0xFFFFFFFF


def pack_logprobs(entries, k: int) -> bytes:
    """Per token: float32 logprob, then k x (uint32 token id, float32 logprob),
    little-endian; a shorter top list is padded with id 0xFFFFFFFF. Fixed size,
    4 + 8k bytes a token, so a delta is written at its offset."""
    record = struct.Struct("<f" + "If" * k)
    out = bytearray()
    for lp, top in entries:
        pairs = list(top)[:k]
        pairs += [(_NO_TOKEN, 0.0)] * (k - len(pairs))
        out += record.pack(lp, *(x for pair in pairs for x in pair))
    return bytes(out)


def unpack_logprobs(data: bytes | None, k: int) -> list[tuple[float, tuple]]:
    if not data:
        return []
    record = struct.Struct("<f" + "If" * k)
    usable = len(data) - len(data) % record.size
    out = []
    for fields in record.iter_unpack(data[:usable]):
        pairs = tuple((fields[i], fields[i + 1]) for i in range(1, len(fields), 2)
                      if fields[i] != _NO_TOKEN)
        out.append((fields[0], pairs))
    return out


class Store:
    def __init__(self, url: str, prefix: str, result_ttl: float, timeout: float):
        # Reads only (every write goes through the writer), so retrying them is safe:
        # a pooled connection from before a Redis restart fails once, then reconnects.
        self.redis = aioredis.from_url(
            url, decode_responses=False, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
            retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError])
        self.prefix = prefix
        self.ttl = max(1, math.ceil(result_ttl))
        pool = self.redis.connection_pool
        self.lean = LeanRedis(pool.connection_kwargs, timeout=timeout,
                              tls=issubclass(pool.connection_class, aioredis.SSLConnection))
        self._submit = self.lean.script(lua.SUBMIT)
        self._pop = self.lean.script(lua.POP)
        self._pop_ids = self.lean.script(lua.POP_IDS)
        self._step = self.lean.script(lua.STEP)
        self._requeue = self.lean.script(lua.REQUEUE)
        self._move = self.lean.script(lua.MOVE)
        self._kick = self.lean.script(lua.KICK)
        self._finish = self.lean.script(lua.FINISH)
        self._abandon = self.lean.script(lua.ABANDON)
        self._restore = self.lean.script(lua.RESTORE)
        self._leases = self.lean.script(lua.LEASES)
        self._renew_router = self.lean.script(lua_routers.RENEW_ROUTER)
        self._sweep_routers = self.lean.script(lua_routers.SWEEP_ROUTERS)
        self._sweep_inflight = self.lean.script(lua_routers.SWEEP_INFLIGHT)
        self._attach = self.lean.script(lua_routers.ATTACH)
        self._adopt = self.lean.script(lua_routers.ADOPT)
        self._replica_left = self.lean.script(lua_routers.REPLICA_LEFT)
        self._register_router = self.redis.register_script(lua_routers.REGISTER_ROUTER)
        self._leave_router = self.redis.register_script(lua_routers.LEAVE_ROUTER)

    # ---- keys ----
    def req_key(self, rid: str) -> str:
        return f"{self.prefix}req:{rid}"

    def out_key(self, rid: str) -> str:
        return f"{self.prefix}out:{rid}"

    def txt_key(self, rid: str) -> str:
        return f"{self.prefix}txt:{rid}"

    def lp_key(self, rid: str) -> str:
        return f"{self.prefix}lp:{rid}"

    def queue_key(self, name: str) -> str:
        return f"{self.prefix}q:{name}"

    def events_key(self, router_id: str) -> str:
        return f"{self.prefix}ev:{router_id}"

    @property
    def inflight_key(self) -> str:
        return f"{self.prefix}inflight"

    @property
    def live_key(self) -> str:
        return f"{self.prefix}live"

    async def ping(self) -> None:
        await self.redis.ping()

    async def close(self) -> None:
        self.lean.close()
        await self.redis.aclose()

    # ---- writes (see lua.py for each script's arguments) ----
    def submit(self, rid: str, token: str, digest: str, spec_json: str, prompt_ids, max_tokens: int,
               priority: int, arrival: float, stream_interval: int, queue: str,
               tell_others: bool = True, replica: str = "", lease_expiry: float = 0.0) -> Write:
        """Reply: (1, member, b'') stored; (0, digest, state) the id is taken.
        tell_others False: no kick to the other routers (the caller pops it itself).
        replica: stored leased to it until lease_expiry (taken at arrival), not queued."""
        return Write(self._submit, (self.prefix,),
                     (rid, token, digest, spec_json, pack_tokens(prompt_ids), len(prompt_ids),
                      max_tokens, priority, repr(arrival), int(arrival * 1e6), stream_interval, queue,
                      1 if tell_others else 0, replica, repr(lease_expiry)),
                     reply_arity=lua.SUBMIT_REPLY_ITEMS, item_args=lua.SUBMIT_ITEM_ARGS, bounded=True)

    def restore(self, rid: str, token: str, digest: str, spec_json: str, prompt_ids,
                max_tokens: int, priority: int, arrival: float, stream_interval: int,
                replica: str, assignments: int, requeues: int, lease_expiry: float, *,
                front: bool) -> Write:
        """Stores again a running request whose record Redis lost (lua.RESTORE),
        naming this router a front if it is one. Reply: 1 stored, 0 it had a
        record, 2 abandoned (ABANDON's tombstone holds this submit token)."""
        return Write(self._restore, (self.prefix,),
                     (rid, token, digest, spec_json, pack_tokens(prompt_ids), len(prompt_ids),
                      max_tokens, priority, repr(arrival), int(arrival * 1e6), stream_interval,
                      replica, assignments, requeues, repr(lease_expiry), 1 if front else 0),
                     reply_arity=1, item_args=lua.RESTORE_ITEM_ARGS)

    def pop(self, queue: str, replica: str, max_requests: int, max_prompt_tokens: int | None,
            lease_expiry: float, now: float, token: str) -> Write:
        """Takes from the head while token credit is left (None: no token limit).
        Reply: lua.POP's flat list; `popped` reads it."""
        return Write(self._pop, self._pop_args(queue, replica, max_requests, max_prompt_tokens,
                                               lease_expiry, now, token),
                     reply_arity=-1, numkeys=2)

    def pop_ids(self, queue: str, replica: str, max_requests: int, max_prompt_tokens: int | None,
                lease_expiry: float, now: float, token: str, held: list[str],
                ids: list[str]) -> Write:
        """Takes these requests, those still queued in `queue`, in this order, while
        the queue's first request is one of `held` (the oldest this router holds
        there, len(ids) + 1 of them); then the rest from the head as `pop` does.
        Reply: as `pop`'s."""
        return Write(self._pop_ids, self._pop_args(queue, replica, max_requests, max_prompt_tokens,
                                                   lease_expiry, now, token)
                     + (queue, len(held), *held, *ids),
                     reply_arity=-1, numkeys=2)

    def _pop_args(self, queue, replica, max_requests, max_prompt_tokens, lease_expiry, now,
                  token) -> tuple:
        """lua._POP_PRELUDE's keys and arguments."""
        tokens = -1 if max_prompt_tokens is None else max(0, max_prompt_tokens)
        return (self.queue_key(queue), self.inflight_key, self.prefix, replica,
                repr(lease_expiry), repr(now), token, max_requests, tokens)

    @staticmethod
    def popped(reply) -> list["Popped"]:
        out = []
        for i in range(0, len(reply) - 1, lua.POP_REPLY_ITEMS):
            rid, n, rq, out_len, rec = reply[i:i + lua.POP_REPLY_ITEMS]
            rid = rid.decode()
            out.append(Popped(rid, int(n), int(rq), int(out_len),
                              record_from_flat(rid, rec) if rec else None))
        return out

    @staticmethod
    def left_after_pop(reply) -> int:
        """Members left in the popped queue once the pop ran (0: it is empty)."""
        return int(reply[-1])

    def step(self, deltas: list) -> Write:
        """deltas: one tuple each, lua.STEP's plain form (6 fields) or its full
        form (17); reply: per delta 1 written, 0 dropped, 2 a hole (lua.STEP)."""
        args: list = []
        plain = True
        for d in deltas:
            assert len(d) in (lua.STEP_PLAIN_ARGS, lua.STEP_FULL_ARGS), len(d)
            is_plain = len(d) == lua.STEP_PLAIN_ARGS
            plain = plain and is_plain
            args.append("p" if is_plain else "f")
            args.extend(d)
        # Only middle output may wait for a fuller batch (writer.py: linger): a
        # first token, a finish or logprobs go in the full form and at once.
        return Write(self._step, (self.prefix, self.ttl), args, item_count=len(deltas),
                     reply_arity=1, lingers=plain)

    def requeue(self, items: list) -> Write:
        """items: (id, queue, expected owner, expected assignment count, requeues) flattened."""
        return Write(self._requeue, (self.prefix,), items, item_args=lua.REQUEUE_ITEM_ARGS)

    def move(self, items: list) -> Write:
        """items: (id, source queue or '', destination) flattened."""
        return Write(self._move, (self.prefix,), items, item_args=lua.MOVE_ITEM_ARGS)

    def kick(self) -> Write:
        """Tells the other live routers the shared queue has work (lua.KICK)."""
        return Write(self._kick, (self.prefix,), reply_arity=-1)

    def finish(self, rid: str, fields: dict) -> Write:
        items = [rid, len(fields)]
        for k, v in fields.items():
            items += [k, v]
        return Write(self._finish, (self.prefix, self.ttl), items, item_args=len(items))

    def abandon(self, rid: str, token: str) -> Write:
        return Write(self._abandon, (self.prefix, self.ttl), (rid, token),
                     item_args=lua.ABANDON_ITEM_ARGS)

    def _lease_write(self, leases: dict[str, float], mode: str) -> Write:
        items = []
        for rid, expiry in leases.items():
            items += [rid, repr(expiry)]
        return Write(self._leases, (self.prefix, mode), items, item_args=lua.LEASES_ITEM_ARGS)

    def renew_leases(self, leases: dict[str, float]) -> Write:
        return self._lease_write(leases, "XX")

    # ---- routers' liveness (lua.FENCE) ----
    async def register_router(self, router_id: str, ttl: float) -> str:
        """A fresh epoch and lease for this router; the epoch, as the writer sends it."""
        epoch = await self._register_router(args=[self.prefix, router_id, repr(ttl)])
        return str(int(epoch))

    async def leave_router(self, router_id: str) -> None:
        await self._leave_router(args=[self.prefix, router_id])

    def renew_router(self, ttl: float, replicas: int) -> Write:
        """Reply: how many replicas the other live routers have."""
        return Write(self._renew_router, (self.prefix, repr(ttl), replicas), reply_arity=-1)

    def sweep_routers(self) -> Write:
        return Write(self._sweep_routers, (self.prefix,), reply_arity=-1)

    def sweep_inflight(self, grace: float, limit: int = 500) -> Write:
        return Write(self._sweep_inflight, (self.prefix, repr(grace), limit), reply_arity=-1)

    def attach(self, rid: str, digest: str) -> Write:
        """Reply: the record (record_from_flat it) or b''."""
        return Write(self._attach, (self.prefix, rid, digest), reply_arity=-1)

    def adopt(self, replica: str, lease_expiry: float, ids: list[str]) -> Write:
        """Reply: per id its flat record, or b'' when not kept."""
        return Write(self._adopt, (self.prefix, replica, repr(lease_expiry), *ids), reply_arity=-1)

    def replica_left(self, replica: str) -> Write:
        return Write(self._replica_left, (self.prefix, replica), reply_arity=-1)

    # ---- events (router/events.py) ----
    async def read_events(self, router_id: str, after: str, block_ms: int, count: int):
        """Events after `after` on this router's stream: [(id, {field: value})]."""
        reply = await self.redis.xread({self.events_key(router_id): after}, count=count,
                                       block=block_ms)
        return reply[0][1] if reply else []

    @staticmethod
    def barrier(on_done) -> Write:
        return Write(None, on_done=on_done)

    # ---- reads ----
    async def load_requests(self, ids: list[str]) -> list[dict | None]:
        out: list[dict | None] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            pipe = self.redis.pipeline(transaction=False)
            for rid in chunk:
                pipe.hgetall(self.req_key(rid))
                pipe.get(self.out_key(rid))
                pipe.get(self.txt_key(rid))
                pipe.get(self.lp_key(rid))
            res = await pipe.execute()
            for i, rid in enumerate(chunk):
                h, toks, txt, lp = res[4 * i:4 * i + 4]
                out.append(_record(rid, {k.decode(): v for k, v in h.items()}, toks, txt, lp)
                           if h else None)
        return out

    async def missing(self, ids: list[str]) -> list[str]:
        """The requests among ids that Redis holds no record of."""
        out: list[str] = []
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            pipe = self.redis.pipeline(transaction=False)
            for rid in chunk:
                pipe.exists(self.req_key(rid))
            out += [rid for rid, n in zip(chunk, await pipe.execute()) if not n]
        return out

    async def live_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(self.live_key))


@dataclass(frozen=True)
class Popped:
    """One request a pop took: its assignment count and requeues as Redis has
    them, its output length there, and its record when the caller is not its front."""
    id: str
    assignments: int
    requeues: int
    output_len: int
    record: dict | None


def _record(rid: str, fields: dict, toks, txt, lp) -> dict:
    rec = dict(fields)
    rec["id"] = rid
    rec["tokens"] = unpack_tokens(toks)
    rec["text"] = txt or b""
    rec["logprobs"] = lp or b""
    return rec


def record_from_flat(rid: str, flat) -> dict | None:
    """A record as lua_common.record_ returns it, in load_requests' shape."""
    if not flat:
        return None
    fields = {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}
    return _record(rid, fields, fields.pop("_out"), fields.pop("_txt"), fields.pop("_lp"))

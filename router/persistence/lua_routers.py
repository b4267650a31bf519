"""Lua scripts of routers sharing one Redis: their liveness leases, and how a
router takes in a request another router accepted or ran.

A router joins with REGISTER_ROUTER (a fresh epoch, a lease), renews through
its ordered writer, and leaves with LEAVE_ROUTER. SWEEP_ROUTERS forgets the
routers whose lease lapsed; SWEEP_INFLIGHT puts back in the shared queue the
running requests whose lease lapsed while their back router is gone. ATTACH
makes the caller a front of a request (a client re-attached there); ADOPT
makes it the back router of requests a replica that registered with it holds.
"""

from __future__ import annotations

from router.persistence.lua_common import FENCE_EXPIRY_MS, fenced

# A router joins: a fresh epoch for its id and a lease of ttl seconds (its score
# in P routers, and its fence key, lua_common.FENCE).
# ARGV: prefix, router id, ttl -> the epoch.
REGISTER_ROUTER = """
local prefix, id = ARGV[1], ARGV[2]
local epoch = redis.call('INCR', prefix .. 'epoch')
local t = redis.call('TIME')
local expiry = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3])
redis.call('HSET', prefix .. 'router:' .. id, 'epoch', epoch, 'started', t[1])
redis.call('ZADD', prefix .. 'routers', expiry, id)
redis.call('SET', prefix .. 'fence:' .. id, epoch, 'PXAT', %(expiry_ms)s)
return epoch
""" % {"expiry_ms": FENCE_EXPIRY_MS % "expiry"}

# Extends the calling router's lease (fenced: a lapsed one is not revived) and
# records how many replicas it has. ARGV: prefix, ttl, replicas -> {the replicas
# of the other live routers (a router with none of its own still takes requests
# while they have some), how many other live routers there are}.
RENEW_ROUTER = fenced("""
local expiry = now_ + tonumber(ARGV[2])
redis.call('ZADD', ARGV[1] .. 'routers', expiry, router_)
redis.call('SET', ARGV[1] .. 'fence:' .. router_, epoch_, 'PXAT', %(expiry_ms)s)
redis.call('HSET', ARGV[1] .. 'router:' .. router_, 'nrep', ARGV[3])
local others, routers = 0, 0
for _, r in ipairs(redis.call('ZRANGEBYSCORE', ARGV[1] .. 'routers', now_, '+inf')) do
  if r ~= router_ then
    others = others + tonumber(redis.call('HGET', ARGV[1] .. 'router:' .. r, 'nrep') or '0')
    routers = routers + 1
  end
end
return {others, routers}
""" % {"expiry_ms": FENCE_EXPIRY_MS % "expiry"})

# A router leaving in good order gives its lease up at once. ARGV: prefix, id.
LEAVE_ROUTER = """
redis.call('ZREM', ARGV[1] .. 'routers', ARGV[2])
redis.call('DEL', ARGV[1] .. 'router:' .. ARGV[2], ARGV[1] .. 'ev:' .. ARGV[2],
  ARGV[1] .. 'fence:' .. ARGV[2])
return 1
"""

# Moves every queued request of a replica's own queue to the shared queue.
QUEUE_TO_SHARED = """
local function queue_to_shared_(replica)
  local src = p_ .. 'q:r:' .. replica
  local moved = 0
  for _, m in ipairs(redis.call('ZRANGE', src, 0, -1)) do
    local h = p_ .. 'req:' .. string.sub(m, 30)
    local st, pr = unpack(redis.call('HMGET', h, 'st', 'pr'))
    if st == 'q' then
      redis.call('ZADD', p_ .. 'q:pending', -tonumber(pr), m)
      redis.call('HSET', h, 'q', 'pending')
      moved = moved + 1
    end
  end
  redis.call('DEL', src)
  return moved
end
"""

# Forgets routers whose lease lapsed: their ids, epochs and event streams. The
# own queues of replicas that were connected to one go to the shared queue
# (per-replica policies), so no request waits for a replica that may never
# come back. ARGV: prefix -> the ids forgotten.
SWEEP_ROUTERS = fenced(QUEUE_TO_SHARED + """
local prefix = ARGV[1]
local dead = redis.call('ZRANGEBYSCORE', prefix .. 'routers', '-inf', '(' .. now_)
local moved = 0
for _, id in ipairs(dead) do
  local fields = redis.call('HKEYS', prefix .. 'router:' .. id)
  for _, f in ipairs(fields) do
    if string.sub(f, 1, 2) == 'r:' then moved = moved + queue_to_shared_(string.sub(f, 3)) end
  end
  redis.call('ZREM', prefix .. 'routers', id)
  redis.call('DEL', prefix .. 'router:' .. id, prefix .. 'ev:' .. id, prefix .. 'fence:' .. id)
end
if moved > 0 then kick_() end
return dead
""")

# A replica's session with the caller ended: what still waits in its own queue
# (requests the caller did not hold, or could not re-place) goes to the shared
# queue. ARGV: prefix, replica -> how many moved.
REPLICA_LEFT = fenced(QUEUE_TO_SHARED + """
redis.call('HDEL', ARGV[1] .. 'router:' .. router_, 'r:' .. ARGV[2])
local moved = queue_to_shared_(ARGV[2])
if moved > 0 then kick_() end
return moved
""")

# Running requests whose in-flight lease lapsed and whose back router is gone
# (or has not renewed them for a further `grace` seconds: no live router holds
# them) go back to the front of the shared queue with their output so far.
# Entries of requests no longer running are dropped. Any live router runs it;
# it is idempotent. ARGV: prefix, grace seconds, at most this many -> how many moved.
SWEEP_INFLIGHT = fenced("""
local prefix, grace = ARGV[1], tonumber(ARGV[2])
local key = prefix .. 'inflight'
local moved = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', key, '-inf', now_, 'LIMIT', 0, tonumber(ARGV[3]))) do
  local h = prefix .. 'req:' .. id
  local st, br, m, pr = unpack(redis.call('HMGET', h, 'st', 'br', 'm', 'pr'))
  if st ~= 'r' then
    redis.call('ZREM', key, id)
  elseif (not live_(br)) or tonumber(redis.call('ZSCORE', key, id)) + grace < now_ then
    redis.call('ZREM', key, id)
    redis.call('ZADD', prefix .. 'q:pending', -tonumber(pr), m)
    redis.call('HSET', h, 'st', 'q', 'o', '', 'br', '', 'q', 'pending')
    redis.call('HINCRBY', h, 'rq', 1)
    moved = moved + 1
  end
end
if moved > 0 then kick_() end
return moved
""")

# A client (re-)attached at the caller: unless the request has finished, the
# caller becomes one of its fronts (fronts whose lease lapsed are dropped), so
# every later delta reaches it. The record is read in the same step, so the
# output it holds and the deltas that follow meet exactly.
# ARGV: prefix, id, digest (a different body attaches nothing)
# -> the record (record_), or '' when there is none.
ATTACH = fenced("""
local prefix, id = ARGV[1], ARGV[2]
local h = prefix .. 'req:' .. id
if redis.call('EXISTS', h) == 0 then return '' end
local st, d = unpack(redis.call('HMGET', h, 'st', 'd'))
if st ~= 'f' and d == ARGV[3] then
  local fronts = {}
  for _, r in ipairs(fronts_(h)) do
    if r ~= router_ and live_(r) then fronts[#fronts + 1] = r end
  end
  fronts[#fronts + 1] = router_
  redis.call('HSET', h, 'fe', table.concat(fronts, ' '))
  if st == 'r' and not redis.call('ZSCORE', prefix .. 'inflight', id) then
    -- running with no lease at all (it cannot lapse): one that lapses now
    redis.call('ZADD', prefix .. 'inflight', now_, id)
  end
end
return record_(id)
""")

# A replica registered with the caller holding these requests: each one still
# recorded as running on that replica is now run through the caller (its
# back router), with a fresh in-flight lease; the router it ran through before,
# if live, hears that it moved ('m'). Nothing is recomputed. The caller records
# the replica as its own (SWEEP_ROUTERS, REPLICA_LEFT).
# ARGV: prefix, replica, lease expiry, then ids -> per id its record, or '' when
# it is not kept (requeued, finished or gone: the replica drops it).
ADOPT = fenced("""
local prefix, replica, expiry = ARGV[1], ARGV[2], ARGV[3]
if router_ ~= '' then redis.call('HSET', prefix .. 'router:' .. router_, 'r:' .. replica, 1) end
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  local st, o, br, n = unpack(redis.call('HMGET', h, 'st', 'o', 'br', 'n'))
  if st == 'r' and o == replica then
    if br and br ~= '' and br ~= router_ and live_(br) then emit_(br, 'k', 'm', 'id', id, 'n', n) end
    redis.call('HSET', h, 'br', router_)
    redis.call('ZADD', prefix .. 'inflight', expiry, id)
    out[#out + 1] = record_(id)
  else
    out[#out + 1] = ''
  end
end
return out
""")

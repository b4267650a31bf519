"""Lua scripts: every multi-key transition of a request is one atomic script.

Keys are built inside the scripts from the prefix (ARGV[1]), so the router
needs a single (non-cluster) Redis. Key layout: router/persistence/store.py.

Every script is idempotent: the writer (writer.py) retries a whole flush when
a reply is lost, so a script may run again after it already ran, possibly
after later scripts of the same flush. Each one therefore checks the state it
expects (a submit token, an assignment count, a source queue) and does
nothing when the record has moved on; output is written with SETRANGE at its
offset, never appended.

Scripts that take items repeat a fixed group of arguments per item, so the
writer can merge consecutive calls of one script into one.

Fencing: the writer appends the router's id and epoch to every call, and
each script first checks them (FENCE): a router whose liveness lease has
lapsed, or whose epoch is not the one registered for its id, writes nothing
and gets a FENCED error. Several routers share one Redis, and one that was
cut off must not overwrite what the others did meanwhile. The lease is
judged by Redis's own clock (TIME), so routers' clocks need not agree.
"""

from __future__ import annotations

# Pops the router id and epoch the writer appended (so every script's own
# arguments keep their places) and refuses to run for a fenced router.
FENCE = """
local epoch_ = table.remove(ARGV)
local router_ = table.remove(ARGV)
if router_ ~= '' then
  local p_ = ARGV[1]
  local expiry_ = redis.call('ZSCORE', p_ .. 'routers', router_)
  local t_ = redis.call('TIME')
  if (not expiry_) or tonumber(expiry_) < tonumber(t_[1]) + tonumber(t_[2]) / 1e6
      or redis.call('HGET', p_ .. 'router:' .. router_, 'epoch') ~= epoch_ then
    return redis.error_reply('FENCED router ' .. router_ .. ' epoch ' .. epoch_ .. ' holds no live lease')
  end
end
"""


def fenced(body: str) -> str:
    return FENCE + body

# ARGV: prefix, then 12 per request:
#   id, submit token, digest, spec json, packed prompt ids, prompt_len,
#   max_tokens, priority, arrival, arrival_us, stream_interval, queue name
# -> 3 per request: 1, member, '' when stored (also when this very submit
#    stored it before: same token); 0, digest, state when the id is taken.
SUBMIT = fenced("""
local prefix = ARGV[1]
local out = {}
for i = 2, #ARGV, 12 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  if redis.call('EXISTS', h) == 1 then
    if redis.call('HGET', h, 'tok') == ARGV[i + 1] then
      out[#out + 1] = 1
      out[#out + 1] = redis.call('HGET', h, 'm')
      out[#out + 1] = ''
    else
      out[#out + 1] = 0
      out[#out + 1] = redis.call('HGET', h, 'd') or ''
      out[#out + 1] = redis.call('HGET', h, 'st') or ''
    end
  else
    local seq = redis.call('INCR', prefix .. 'seq')
    local member = string.format('%016d%012d:', tonumber(ARGV[i + 9]), seq) .. id
    redis.call('HSET', h, 'tok', ARGV[i + 1], 'd', ARGV[i + 2], 'sp', ARGV[i + 3],
      'p', ARGV[i + 4], 'pl', ARGV[i + 5], 'mt', ARGV[i + 6], 'pr', ARGV[i + 7],
      'at', ARGV[i + 8], 'si', ARGV[i + 10], 'q', ARGV[i + 11], 'm', member, 'seq', seq,
      'st', 'q', 'rq', 0, 'n', 0)
    redis.call('ZADD', prefix .. 'q:' .. ARGV[i + 11], -tonumber(ARGV[i + 7]), member)
    redis.call('SADD', prefix .. 'live', id)
    out[#out + 1] = 1
    out[#out + 1] = member
    out[#out + 1] = ''
  end
end
return out
""")
SUBMIT_ITEM_ARGS = 12
SUBMIT_REPLY_ITEMS = 3

# Atomic peek-check-pop. KEYS: queue zset, inflight zset.
# ARGV: prefix, replica, max_requests, max_prompt_tokens (-1: no limit),
#       lease expiry, now, pop token
# Takes from the head while token credit is left (head-of-line: arrival order
# holds). The last request taken may overrun the credit: a replica grants tokens
# for the prefill it can start soon, and a prompt longer than that must still
# start on a replica with room. Cost = prompt + output so far (recomputed).
# A pop that ran before (same token) returns what it took then.
POP = fenced("""
local prefix, replica = ARGV[1], ARGV[2]
local n, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local done = prefix .. 'pop:' .. ARGV[7]
if redis.call('EXISTS', done) == 1 then return redis.call('LRANGE', done, 0, -1) end
local limited = budget >= 0
local taken = {}
if n <= 0 then return taken end
local heads = redis.call('ZRANGE', KEYS[1], 0, n - 1)
for _, m in ipairs(heads) do
  local id = string.sub(m, 30)
  local h = prefix .. 'req:' .. id
  if redis.call('HGET', h, 'st') ~= 'q' then
    redis.call('ZREM', KEYS[1], m)
  else
    if limited and budget <= 0 then break end
    local cost = tonumber(redis.call('HGET', h, 'pl'))
      + math.floor(redis.call('STRLEN', prefix .. 'out:' .. id) / 4)
    budget = budget - cost
    redis.call('ZREM', KEYS[1], m)
    redis.call('ZADD', KEYS[2], ARGV[5], id)
    redis.call('HSET', h, 'st', 'r', 'o', replica, 'q', '', 'asg', ARGV[6])
    redis.call('HINCRBY', h, 'n', 1)
    taken[#taken + 1] = id
  end
end
if #taken > 0 then
  redis.call('RPUSH', done, unpack(taken))
  redis.call('EXPIRE', done, 300)
end
return taken
""")

# Back to the FRONT of a queue: same score and member as at arrival.
# ARGV: prefix, then 5 per request: id, queue name, expected owner,
#       expected assignment count, requeues so far.
REQUEUE = fenced("""
local prefix = ARGV[1]
for i = 2, #ARGV, 5 do
  local id, qname = ARGV[i], ARGV[i + 1]
  local h = prefix .. 'req:' .. id
  local st, owner, n = unpack(redis.call('HMGET', h, 'st', 'o', 'n'))
  if st == 'r' and owner == ARGV[i + 2] and n == ARGV[i + 3] then
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('ZADD', prefix .. 'q:' .. qname, -tonumber(redis.call('HGET', h, 'pr')),
      redis.call('HGET', h, 'm'))
    redis.call('HSET', h, 'st', 'q', 'o', '', 'q', qname, 'rq', ARGV[i + 4])
  end
end
return 1
""")
REQUEUE_ITEM_ARGS = 5

# Moves queued requests between queues (a gone replica's set is redistributed;
# recovery gathers everything into the shared queue).
# ARGV: prefix, then 3 per request: id, source queue ('' = wherever it is), destination.
MOVE = fenced("""
local prefix = ARGV[1]
for i = 2, #ARGV, 3 do
  local id, src, dst = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local h = prefix .. 'req:' .. id
  local st, q, m = unpack(redis.call('HMGET', h, 'st', 'q', 'm'))
  if st == 'q' and (src == '' or q == src) then
    redis.call('ZREM', prefix .. 'q:' .. q, m)
    redis.call('ZADD', prefix .. 'q:' .. dst, -tonumber(redis.call('HGET', h, 'pr')), m)
    redis.call('HSET', h, 'q', dst)
  end
end
return 1
""")
MOVE_ITEM_ARGS = 3

# Everything one flush of StepOutputs (from any replicas) records.
# ARGV: prefix, ttl seconds, then 16 per delta:
#   id, token byte offset, packed tokens, text byte offset, text, ft, fs,
#   finished (1/0), fr, err, rep, fin, pre, logprob byte offset, packed logprobs,
#   cached tokens
# ('' = nothing to write for that field). A finish also stamps ft/fs, leaves
# the inflight and live sets and starts the result TTL on its keys. Output of
# a request finished meanwhile (a cancel) gets the TTL too; a request whose
# record is gone (expired) is skipped, so no key without a TTL is made.
STEP = fenced("""
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 16 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  if redis.call('EXISTS', h) == 1 then
    local o, t, l = prefix .. 'out:' .. id, prefix .. 'txt:' .. id, prefix .. 'lp:' .. id
    if ARGV[i + 2] ~= '' then redis.call('SETRANGE', o, tonumber(ARGV[i + 1]), ARGV[i + 2]) end
    if ARGV[i + 4] ~= '' then redis.call('SETRANGE', t, tonumber(ARGV[i + 3]), ARGV[i + 4]) end
    if ARGV[i + 14] ~= '' then redis.call('SETRANGE', l, tonumber(ARGV[i + 13]), ARGV[i + 14]) end
    if ARGV[i + 5] ~= '' then redis.call('HSET', h, 'ft', ARGV[i + 5]) end
    if ARGV[i + 6] ~= '' then redis.call('HSET', h, 'fs', ARGV[i + 6]) end
    if ARGV[i + 15] ~= '' then redis.call('HSET', h, 'ct', ARGV[i + 15]) end
    if ARGV[i + 7] == '1' then
      redis.call('HSET', h, 'fr', ARGV[i + 8], 'err', ARGV[i + 9], 'rep', ARGV[i + 10],
        'fin', ARGV[i + 11], 'pre', ARGV[i + 12], 'st', 'f', 'q', '', 'o', '')
      redis.call('ZREM', prefix .. 'inflight', id)
      redis.call('SREM', prefix .. 'live', id)
    end
    if ARGV[i + 7] == '1' or redis.call('HGET', h, 'st') == 'f' then
      redis.call('EXPIRE', h, ttl)
      redis.call('EXPIRE', o, ttl)
      redis.call('EXPIRE', t, ttl)
      redis.call('EXPIRE', l, ttl)
    end
  end
end
return 1
""")
STEP_ITEM_ARGS = 16

# Ends requests that did not finish through a step (cancel, errors, requeue
# limit), queued or running. ARGV: prefix, ttl seconds, then 2 + 2k per request:
#   id, k, then k field/value pairs for the hash.
FINISH = fenced("""
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local i = 3
while i <= #ARGV do
  local id, k = ARGV[i], tonumber(ARGV[i + 1])
  local h = prefix .. 'req:' .. id
  if redis.call('EXISTS', h) == 1 then
    local st, q, m = unpack(redis.call('HMGET', h, 'st', 'q', 'm'))
    if st == 'q' then redis.call('ZREM', prefix .. 'q:' .. q, m) end
    for j = 1, k do
      redis.call('HSET', h, ARGV[i + 2 * j], ARGV[i + 1 + 2 * j])
    end
    redis.call('HSET', h, 'st', 'f', 'q', '', 'o', '')
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('SREM', prefix .. 'live', id)
    redis.call('EXPIRE', h, ttl)
    redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
    redis.call('EXPIRE', prefix .. 'txt:' .. id, ttl)
    redis.call('EXPIRE', prefix .. 'lp:' .. id, ttl)
  end
  i = i + 2 + 2 * k
end
return 1
""")

# Removes a request whose submit timed out at the router (its client was told
# UNAVAILABLE), if it is still the one that submit stored, so a retry with the
# same request_id starts it afresh. A pop may have taken it meanwhile (in the
# same flush as its submit); no replica was sent it, so it goes all the same.
# ARGV: prefix, then 2 per request: id, submit token.
ABANDON = fenced("""
local prefix = ARGV[1]
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  local st, tok, q, m = unpack(redis.call('HMGET', h, 'st', 'tok', 'q', 'm'))
  if st and st ~= 'f' and tok == ARGV[i + 1] then
    if st == 'q' then redis.call('ZREM', prefix .. 'q:' .. q, m) end
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('DEL', h, prefix .. 'out:' .. id, prefix .. 'txt:' .. id, prefix .. 'lp:' .. id)
    redis.call('SREM', prefix .. 'live', id)
  end
end
return 1
""")
ABANDON_ITEM_ARGS = 2

# A router joins: a fresh epoch for its id and a lease of ttl seconds.
# ARGV: prefix, router id, ttl -> the epoch.
REGISTER_ROUTER = """
local prefix, id = ARGV[1], ARGV[2]
local epoch = redis.call('INCR', prefix .. 'epoch')
local t = redis.call('TIME')
redis.call('HSET', prefix .. 'router:' .. id, 'epoch', epoch, 'started', t[1])
redis.call('ZADD', prefix .. 'routers', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3]), id)
return epoch
"""

# Extends the calling router's lease (fenced: a lapsed one is not revived).
# ARGV: prefix, ttl -> 1.
RENEW_ROUTER = fenced("""
local t = redis.call('TIME')
redis.call('ZADD', ARGV[1] .. 'routers', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[2]), router_)
return 1
""")

# A router leaving in good order gives its lease up at once. ARGV: prefix, id.
LEAVE_ROUTER = """
redis.call('ZREM', ARGV[1] .. 'routers', ARGV[2])
redis.call('DEL', ARGV[1] .. 'router:' .. ARGV[2], ARGV[1] .. 'ev:' .. ARGV[2])
return 1
"""

# Forgets routers whose lease lapsed: their ids, epochs and event streams.
# ARGV: prefix -> the ids forgotten.
SWEEP_ROUTERS = fenced("""
local prefix = ARGV[1]
local t = redis.call('TIME')
local dead = redis.call('ZRANGEBYSCORE', prefix .. 'routers', '-inf',
  tonumber(t[1]) + tonumber(t[2]) / 1e6)
for _, id in ipairs(dead) do
  redis.call('ZREM', prefix .. 'routers', id)
  redis.call('DEL', prefix .. 'router:' .. id, prefix .. 'ev:' .. id)
end
return dead
""")

# Sets in-flight leases: XX renews only what is still in flight (a live
# replica's requests); without it recovery puts entries back.
# ARGV: prefix, 'XX' or '', then (id, expiry) pairs.
LEASES = fenced("""
local key = ARGV[1] .. 'inflight'
for i = 3, #ARGV, 2 do
  if ARGV[2] == 'XX' then
    redis.call('ZADD', key, 'XX', ARGV[i + 1], ARGV[i])
  else
    redis.call('ZADD', key, ARGV[i + 1], ARGV[i])
  end
end
return 1
""")
LEASES_ITEM_ARGS = 2

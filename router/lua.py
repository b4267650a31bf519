"""Lua scripts: every multi-key transition of a request is one atomic script.

Keys are built inside the scripts from the prefix (ARGV[1]), so the router
needs a single (non-cluster) Redis. Key layout: see router/store.py.
"""

# Stores several new requests and queues each, in one call (keys built from the
# prefix): a request hash, then ZADD by (-priority, arrival, sequence).
# ARGV: prefix, then 10 per request: id, digest, assignment, prompt_len,
#       max_tokens, priority, arrival, arrival_us, stream_interval, queue name
# -> 3 per request: 1, member, '' when stored; 0, digest, state when the id exists.
SUBMIT_MANY = """
local prefix = ARGV[1]
local out = {}
for i = 2, #ARGV, 10 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  if redis.call('EXISTS', h) == 1 then
    out[#out + 1] = 0
    out[#out + 1] = redis.call('HGET', h, 'd') or ''
    out[#out + 1] = redis.call('HGET', h, 'st') or ''
  else
    local seq = redis.call('INCR', prefix .. 'seq')
    local member = string.format('%016d%012d:', tonumber(ARGV[i + 7]), seq) .. id
    redis.call('HSET', h, 'd', ARGV[i + 1], 'a', ARGV[i + 2], 'pl', ARGV[i + 3],
      'mt', ARGV[i + 4], 'pr', ARGV[i + 5], 'at', ARGV[i + 6], 'si', ARGV[i + 8],
      'q', ARGV[i + 9], 'm', member, 'seq', seq, 'st', 'q', 'rq', 0)
    redis.call('ZADD', prefix .. 'q:' .. ARGV[i + 9], -tonumber(ARGV[i + 5]), member)
    out[#out + 1] = 1
    out[#out + 1] = member
    out[#out + 1] = ''
  end
end
return out
"""

# Atomic peek-check-pop. KEYS: queue zset, inflight zset.
# ARGV: prefix, replica, max_requests, max_prompt_tokens (-1: no limit), lease expiry, now
# Takes from the head while token credit is left (head-of-line: arrival order
# holds). The last request taken may overrun the credit: a replica grants tokens
# for the prefill it can start soon, and a prompt longer than that must still
# start on a replica with room. Cost = prompt + output so far (recomputed).
POP = """
local prefix, replica = ARGV[1], ARGV[2]
local n, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local limited = budget >= 0
local taken = {}
if n <= 0 then return taken end
local heads = redis.call('ZRANGE', KEYS[1], 0, n - 1)
for _, m in ipairs(heads) do
  local id = string.sub(m, 30)
  local h = prefix .. 'req:' .. id
  local pl = redis.call('HGET', h, 'pl')
  if not pl then
    redis.call('ZREM', KEYS[1], m)
  else
    local cost = tonumber(pl) + math.floor(redis.call('STRLEN', prefix .. 'out:' .. id) / 4)
    if limited and budget <= 0 then break end
    budget = budget - cost
    redis.call('ZREM', KEYS[1], m)
    redis.call('ZADD', KEYS[2], ARGV[5], id)
    redis.call('HSET', h, 'st', 'r', 'o', replica, 'q', '', 'asg', ARGV[6])
    taken[#taken + 1] = id
  end
end
return taken
"""

# Back to the FRONT of a queue: same score and member as at arrival.
# ARGV: prefix, expected owner ('' = any), then (id, queue name) pairs -> list of 0/1.
REQUEUE = """
local prefix, owner = ARGV[1], ARGV[2]
local result = {}
for i = 3, #ARGV, 2 do
  local id, qname = ARGV[i], ARGV[i + 1]
  local h = prefix .. 'req:' .. id
  local ok = 0
  if redis.call('HGET', h, 'st') == 'r' and (owner == '' or redis.call('HGET', h, 'o') == owner) then
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('ZADD', prefix .. 'q:' .. qname, -tonumber(redis.call('HGET', h, 'pr')),
      redis.call('HGET', h, 'm'))
    redis.call('HSET', h, 'st', 'q', 'o', '', 'q', qname)
    redis.call('HINCRBY', h, 'rq', 1)
    ok = 1
  end
  result[#result + 1] = ok
end
return result
"""

# Moves queued requests to another queue (a gone replica's set is redistributed).
# ARGV: prefix, then (id, queue name) pairs -> list of 0/1.
MOVE = """
local prefix = ARGV[1]
local result = {}
for i = 2, #ARGV, 2 do
  local id, dst = ARGV[i], ARGV[i + 1]
  local h = prefix .. 'req:' .. id
  local ok = 0
  if redis.call('HGET', h, 'st') == 'q' then
    local m = redis.call('HGET', h, 'm')
    redis.call('ZREM', prefix .. 'q:' .. redis.call('HGET', h, 'q'), m)
    redis.call('ZADD', prefix .. 'q:' .. dst, -tonumber(redis.call('HGET', h, 'pr')), m)
    redis.call('HSET', h, 'q', dst)
    ok = 1
  end
  result[#result + 1] = ok
end
return result
"""

# Removes a still-queued request and records it finished.
# ARGV: prefix, id, now, ttl seconds, finish reason, error -> 1 removed, 0 not queued.
CANCEL_QUEUED = """
local prefix, id = ARGV[1], ARGV[2]
local h = prefix .. 'req:' .. id
if redis.call('HGET', h, 'st') ~= 'q' then return 0 end
redis.call('ZREM', prefix .. 'q:' .. redis.call('HGET', h, 'q'), redis.call('HGET', h, 'm'))
redis.call('HSET', h, 'st', 'f', 'fr', ARGV[5], 'err', ARGV[6], 'fin', ARGV[3], 'q', '')
local ttl = tonumber(ARGV[4])
redis.call('EXPIRE', h, ttl)
redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
redis.call('EXPIRE', prefix .. 'txt:' .. id, ttl)
return 1
"""

# Everything one event-loop tick of StepOutputs (from any replicas) records, in
# one call. ARGV: prefix, ttl seconds, then 12 per delta:
#   id, packed tokens, text, ft, fs, finished (1/0), fr, err, rep, fin, pre, asg
# ('' = nothing to write for that field). A finish also stamps ft/fs, leaves the
# inflight set and starts the result TTL on req/out/txt; output keys created
# after the request was finished elsewhere (cancel) get the TTL too.
STEP = """
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 12 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  local o, t = prefix .. 'out:' .. id, prefix .. 'txt:' .. id
  -- An APPEND that creates the key after the request was finished (a cancel
  -- recorded while this write was in flight) must not leave a key without TTL.
  local created = false
  if ARGV[i + 1] ~= '' and redis.call('APPEND', o, ARGV[i + 1]) == #ARGV[i + 1] then
    created = true
  end
  if ARGV[i + 2] ~= '' and redis.call('APPEND', t, ARGV[i + 2]) == #ARGV[i + 2] then
    created = true
  end
  if created and ARGV[i + 5] ~= '1' and redis.call('HGET', h, 'st') == 'f' then
    redis.call('EXPIRE', o, ttl)
    redis.call('EXPIRE', t, ttl)
  end
  if ARGV[i + 5] == '1' then
    redis.call('HSET', h, 'fr', ARGV[i + 6], 'err', ARGV[i + 7], 'rep', ARGV[i + 8],
      'fin', ARGV[i + 9], 'ft', ARGV[i + 3], 'fs', ARGV[i + 4], 'pre', ARGV[i + 10],
      'asg', ARGV[i + 11], 'st', 'f', 'q', '', 'o', '')
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('EXPIRE', h, ttl)
    redis.call('EXPIRE', o, ttl)
    redis.call('EXPIRE', t, ttl)
  elseif ARGV[i + 3] ~= '' and ARGV[i + 4] ~= '' then
    redis.call('HSET', h, 'ft', ARGV[i + 3], 'fs', ARGV[i + 4])
  elseif ARGV[i + 3] ~= '' then
    redis.call('HSET', h, 'ft', ARGV[i + 3])
  elseif ARGV[i + 4] ~= '' then
    redis.call('HSET', h, 'fs', ARGV[i + 4])
  end
end
return 1
"""

# Rewrites requests' records from the router's memory after a failed Redis call
# left them behind (replica death or a step write during a Redis outage).
# ARGV: prefix, ttl seconds, lease expiry, then per request:
#   id, state (q|r|f), queue name, owner, write output (1/0), packed tokens, text,
#   n, then n field/value pairs for the hash.
SYNC = """
local prefix, ttl, lease = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local i = 4
while i <= #ARGV do
  local id, st, qname, owner = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local n = tonumber(ARGV[i + 7])
  local h = prefix .. 'req:' .. id
  local o, t = prefix .. 'out:' .. id, prefix .. 'txt:' .. id
  if redis.call('EXISTS', h) == 1 then
    if ARGV[i + 4] == '1' then
      if ARGV[i + 5] == '' then redis.call('DEL', o) else redis.call('SET', o, ARGV[i + 5]) end
      if ARGV[i + 6] == '' then redis.call('DEL', t) else redis.call('SET', t, ARGV[i + 6]) end
    end
    for j = 1, n do
      redis.call('HSET', h, ARGV[i + 6 + 2 * j], ARGV[i + 7 + 2 * j])
    end
    local m = redis.call('HGET', h, 'm')
    local oldq = redis.call('HGET', h, 'q')
    if oldq and oldq ~= '' and oldq ~= qname then
      redis.call('ZREM', prefix .. 'q:' .. oldq, m)
    end
    if st == 'q' then
      redis.call('ZREM', prefix .. 'inflight', id)
      redis.call('ZADD', prefix .. 'q:' .. qname, -tonumber(redis.call('HGET', h, 'pr')), m)
      redis.call('HSET', h, 'st', 'q', 'q', qname, 'o', '')
    elseif st == 'r' then
      if oldq and oldq ~= '' then redis.call('ZREM', prefix .. 'q:' .. oldq, m) end
      redis.call('ZADD', prefix .. 'inflight', lease, id)
      redis.call('HSET', h, 'st', 'r', 'q', '', 'o', owner)
    else
      if oldq and oldq ~= '' then redis.call('ZREM', prefix .. 'q:' .. oldq, m) end
      redis.call('ZREM', prefix .. 'inflight', id)
      redis.call('HSET', h, 'st', 'f', 'q', '', 'o', '')
      redis.call('EXPIRE', h, ttl)
      redis.call('EXPIRE', o, ttl)
      redis.call('EXPIRE', t, ttl)
    end
  end
  i = i + 8 + 2 * n
end
return 1
"""

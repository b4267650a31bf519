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

Several routers share one Redis. Every script is fenced (lua_common.FENCE: a
router whose lease lapsed writes nothing). Every request records its front
routers (`fe`: they hold its client streams) and its back router (`br`: its
replica runs it). A script that changes a request another router must hear
of tells that router through its event stream (router/events.py).
Per-request fencing: a step, a requeue and an adoption name the assignment
count (`n`) and owner they expect, and only the back router writes a running
request's output, so a router/replica pair that lost a request (requeued,
adopted elsewhere) writes nothing more for it.
"""

from __future__ import annotations

from router.persistence.lua_common import FINISH_EVENT, fenced

# ARGV: prefix, then 15 per request:
#   id, submit token, digest, spec json, packed prompt ids, prompt_len,
#   max_tokens, priority, arrival, arrival_us, stream_interval, queue name,
#   kick (1: tell the other routers of it), replica, lease expiry
# -> 3 per request: 1, member, '' when stored (also when this very submit
#    stored it before: same token); 0, digest, state when the id is taken.
# The caller is the request's front. An arrival in the shared queue with kick
# 1 wakes the other routers (kick_), once per call. A caller with a replica
# ready to take it passes 0 and pops it itself (KICK afterwards if it could
# not: router/scheduling/pull.py), so the other routers do not race it for
# the request (a request run by another router than its front costs an
# event a delta).
# A replica named (not ''): the request was taken at arrival (router/scheduling/
# pull.py, take_at_arrival): it is stored leased to that replica, as a pop
# would lease it (assignment 1, this router its back), and never queued. An id
# already stored is left as it is (the router holds a client's id's Assign for
# this reply, and sends it only if this submit stored the request).
SUBMIT = fenced("""
local prefix = ARGV[1]
local out = {}
local shared = false
for i = 2, #ARGV, 15 do
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
    local replica = ARGV[i + 13]
    redis.call('HSET', h, 'tok', ARGV[i + 1], 'd', ARGV[i + 2], 'sp', ARGV[i + 3],
      'p', ARGV[i + 4], 'pl', ARGV[i + 5], 'mt', ARGV[i + 6], 'pr', ARGV[i + 7],
      'at', ARGV[i + 8], 'si', ARGV[i + 10], 'q', ARGV[i + 11], 'm', member, 'seq', seq,
      'st', 'q', 'rq', 0, 'n', 0, 'fe', router_, 'br', '', 'sat', now_)
    if replica == '' then
      redis.call('ZADD', prefix .. 'q:' .. ARGV[i + 11], -tonumber(ARGV[i + 7]), member)
      shared = shared or (ARGV[i + 11] == 'pending' and ARGV[i + 12] == '1')
    else
      redis.call('ZADD', prefix .. 'inflight', ARGV[i + 14], id)
      redis.call('HSET', h, 'st', 'r', 'o', replica, 'q', '', 'asg', ARGV[i + 8], 'br', router_,
        'ao', redis.call('INCR', prefix .. 'ao'), 'pat', now_, 'n', 1)
    end
    redis.call('SADD', prefix .. 'live', id)
    out[#out + 1] = 1
    out[#out + 1] = member
    out[#out + 1] = ''
  end
end
if shared then kick_() end
return out
""")
SUBMIT_ITEM_ARGS = 15
SUBMIT_REPLY_ITEMS = 3

# What both pops share. KEYS: queue zset, inflight zset.
# ARGV: prefix, replica, lease expiry, now, pop token, max_requests,
#       max_prompt_tokens (-1: no limit), then each pop's own.
# A pop leases each request it takes: the caller becomes the back router; the
# request's assignment ordinal (`ao`, one counter for all routers) and Redis
# time (`pat`) record the global order of assignment (SUBMIT records `sat`,
# when it was stored), and its other fronts hear that it left the queue ('a').
# A pop that ran before (same token) takes nothing more and returns what it
# took then (`again`: the pop's own body is skipped; P pop:<token> holds the
# ids it took, msgpacked).
# take_from_head(n, budget): up to n from the head while token credit is left
# (budget; -1: no limit) (head-of-line: queue order holds). The last request
# taken may overrun the credit: a replica grants tokens for the prefill it can
# start soon, and a prompt longer than that must still start on a replica with
# room. A request's cost = prompt + output so far (recomputed). Members whose
# request left the queue are dropped.
# -> 5 per request: id, assignment count, requeues, output tokens so far, and
#    its whole record (record_) when the caller is not one of its fronts (it
#    may not hold it: lazy adoption), else ''; then the members left in the
#    queue (stale ones too, so 0 proves it empty): a pop that emptied the queue
#    spares the other pullers a pop that would find nothing.
# A queued request's hash is read once (queued_fields: one HMGET of all a pop
# needs), and a lease keeps what the reply needs.
_POP_PRELUDE = """
local prefix, replica = ARGV[1], ARGV[2]
local done = prefix .. 'pop:' .. ARGV[5]
local prior = redis.call('GET', done)
local again = prior ~= false
local taken = {}
local leased = {}   -- id -> its reply (count, requeues, output length, caller is a front)
if again then taken = cmsgpack.unpack(prior) end
local function is_front(fe)
  for _, r in ipairs(fronts_of_(fe)) do
    if r == router_ then return true end
  end
  return false
end
local function output_len(id)
  return math.floor(redis.call('STRLEN', prefix .. 'out:' .. id) / 4)
end
-- f: the request's queued_fields; out_len: its output_len
local function lease(h, id, member, f, out_len)
  redis.call('ZREM', KEYS[1], member)
  redis.call('ZADD', KEYS[2], ARGV[3], id)
  local count = (tonumber(f[5]) or 0) + 1
  redis.call('HSET', h, 'st', 'r', 'o', replica, 'q', '', 'asg', ARGV[4], 'br', router_,
    'ao', redis.call('INCR', prefix .. 'ao'), 'pat', now_, 'n', count)
  tell_fronts_(f[7], 'k', 'a', 'id', id, 'n', count)
  leased[id] = {count, f[6] or '0', out_len, is_front(f[7])}
  taken[#taken + 1] = id
end
local function queued_fields(h)
  return redis.call('HMGET', h, 'st', 'q', 'm', 'pl', 'n', 'rq', 'fe')
end
local function take_from_head(n, budget)
  local limited = budget >= 0
  if n <= 0 then return end
  for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, n - 1)) do
    local id = string.sub(m, 30)
    local h = prefix .. 'req:' .. id
    local f = queued_fields(h)
    if f[1] ~= 'q' then
      redis.call('ZREM', KEYS[1], m)
    else
      if limited and budget <= 0 then break end
      local out_len = output_len(id)
      budget = budget - (tonumber(f[4]) + out_len)
      lease(h, id, m, f, out_len)
    end
  end
end
local function reply()
  if #taken > 0 and not again then
    redis.call('SET', done, cmsgpack.pack(taken), 'EX', 300)
  end
  local out = {}
  for _, id in ipairs(taken) do
    local r = leased[id]
    if r == nil then   -- a retried pop: as Redis has it now
      local count, rq, fe = unpack(redis.call('HMGET', prefix .. 'req:' .. id, 'n', 'rq', 'fe'))
      r = {count or '0', rq or '0', output_len(id), is_front(fe)}
    end
    out[#out + 1] = id
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
    if r[4] then out[#out + 1] = '' else out[#out + 1] = record_(id) end
  end
  out[#out + 1] = redis.call('ZCARD', KEYS[1])
  return out
end
"""
POP_REPLY_ITEMS = 5

# Atomic peek-check-pop: take_from_head, nothing else.
POP = fenced(_POP_PRELUDE + """
if not again then take_from_head(tonumber(ARGV[6]), tonumber(ARGV[7])) end
return reply()
""")

# Named pop: the requests a policy chose (pull affinity), those still queued in
# that queue, leased as POP does, in the order given. Credit is the router's to
# check (it chose within it). ARGV after the prelude's: queue name, k, the k
# oldest requests of that queue the router holds (k = picks + 1: enough to
# know whether the queue's first request is one of them after each pick), then
# the picks. The router chooses only among the requests it holds: a pick is
# taken only while the queue's first request is one of them. Once another
# leads (an older request of another router, which the caller cannot see, or
# one popped elsewhere meanwhile), the seats and credit left are taken from
# the head as POP does. So another router's request is passed over only by a
# pick made ahead of the caller's own older requests (for its cache); with
# every pick in the caller's queue order this takes what POP would.
POP_IDS = fenced(_POP_PRELUDE + """
local qname, k = ARGV[8], tonumber(ARGV[9])
local function first_queued()
  while true do
    local m = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
    if not m then return nil end
    local id = string.sub(m, 30)
    if redis.call('HGET', prefix .. 'req:' .. id, 'st') == 'q' then return id end
    redis.call('ZREM', KEYS[1], m)
  end
end
if not again then
  local held = {}
  for i = 10, 9 + k do held[ARGV[i]] = true end
  local n, budget = tonumber(ARGV[6]), tonumber(ARGV[7])
  local i = 10 + k
  while true do
    local first = first_queued()
    if first and not held[first] then
      take_from_head(n - #taken, budget)
      break
    end
    if i > #ARGV then break end
    local id = ARGV[i]
    local h = prefix .. 'req:' .. id
    local f = queued_fields(h)
    if f[1] == 'q' and f[2] == qname then
      local out_len = output_len(id)
      if budget >= 0 then budget = math.max(0, budget - (tonumber(f[4]) + out_len)) end
      lease(h, id, f[3], f, out_len)
    end
    i = i + 1
  end
end
return reply()
""")

# Back to the FRONT of a queue: same score and member as at arrival.
# ARGV: prefix, then 5 per request: id, queue name, expected owner,
#       expected assignment count, requeues so far.
# Only the back router requeues (a request adopted by another router meanwhile
# stays where it runs).
REQUEUE = fenced("""
local prefix = ARGV[1]
local shared = false
for i = 2, #ARGV, 5 do
  local id, qname = ARGV[i], ARGV[i + 1]
  local h = prefix .. 'req:' .. id
  local st, owner, n, br = unpack(redis.call('HMGET', h, 'st', 'o', 'n', 'br'))
  if st == 'r' and owner == ARGV[i + 2] and n == ARGV[i + 3] and (br or '') == router_ then
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('ZADD', prefix .. 'q:' .. qname, -tonumber(redis.call('HGET', h, 'pr')),
      redis.call('HGET', h, 'm'))
    redis.call('HSET', h, 'st', 'q', 'o', '', 'br', '', 'q', qname, 'rq', ARGV[i + 4])
    shared = shared or qname == 'pending'
  end
end
if shared then kick_() end
return 1
""")
REQUEUE_ITEM_ARGS = 5

# Tells every other live router the shared queue has work: a router that
# stored arrivals without a kick (SUBMIT) and left some of them queued.
# ARGV: prefix.
KICK = fenced("""
kick_()
return 1
""")

# Moves queued requests between queues (a gone replica's set is redistributed).
# ARGV: prefix, then 3 per request: id, source queue ('' = wherever it is), destination.
MOVE = fenced("""
local prefix = ARGV[1]
local shared = false
for i = 2, #ARGV, 3 do
  local id, src, dst = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local h = prefix .. 'req:' .. id
  local st, q, m = unpack(redis.call('HMGET', h, 'st', 'q', 'm'))
  if st == 'q' and (src == '' or q == src) then
    redis.call('ZREM', prefix .. 'q:' .. q, m)
    redis.call('ZADD', prefix .. 'q:' .. dst, -tonumber(redis.call('HGET', h, 'pr')), m)
    redis.call('HSET', h, 'q', dst)
    shared = shared or dst == 'pending'
  end
end
if shared then kick_() end
return 1
""")
MOVE_ITEM_ARGS = 3

# Everything one flush of StepOutputs (from any replicas) records.
# ARGV: prefix, ttl seconds, then per delta one of two forms, by its first
# argument:
#   'p', id, token byte offset, packed tokens, text byte offset, text,
#        expected assignment count: a plain delta (output only), the form of
#        almost every step; idle, Redis spends 10-19% less CPU on it than
#        on the same delta in the full form at 8 deltas a call
#        (benchmarks/router/step_forms_cost.py)
#   'f', id, token byte offset, packed tokens, text byte offset, text, ft, fs,
#        finished (1/0), fr, err, rep, fin, pre, logprob byte offset,
#        packed logprobs, cached tokens, expected assignment count
# ('' = nothing to write for that field). A delta is written only while the
# request runs under that assignment with the caller as its back router;
# otherwise (requeued, adopted elsewhere, cancelled, expired) it is dropped.
# A finish also stamps ft/fs, leaves the inflight and live sets and starts the
# result TTL on its keys. The request's other fronts get each delta ('d'),
# then its finish. A delta that starts past the recorded output finds
# a hole: Redis lost writes it had acknowledged (a restart from an AOF fsynced
# once a second, a failover to a lagging replica); it writes nothing, and the
# router rewrites the request's output whole from its memory (table.py). A
# request with no record at all (lost the same way, or removed by ABANDON)
# writes nothing either; the router may store it again (RESTORE).
# -> 1 per delta: 1 written, 0 dropped, 2 a hole, 3 no record (nothing written).
STEP = fenced(FINISH_EVENT + """
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local written = {}
local i = 3
while i <= #ARGV do
  local id, tok_at, toks, txt_at, txt, want_n
  local ft, fs, finished, lp_at, lp, ct = '', '', false, '0', '', ''
  local f = i   -- the full form's finish fields: ARGV[f + 9] (fr) .. ARGV[f + 13] (pre)
  if ARGV[i] == 'p' then
    id, tok_at, toks, txt_at, txt, want_n = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
      ARGV[i + 5], ARGV[i + 6]
    i = i + 7
  else
    id, tok_at, toks, txt_at, txt = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
    ft, fs, finished = ARGV[i + 6], ARGV[i + 7], ARGV[i + 8] == '1'
    lp_at, lp, ct, want_n = ARGV[i + 14], ARGV[i + 15], ARGV[i + 16], ARGV[i + 17]
    i = i + 18
  end
  local h = prefix .. 'req:' .. id
  local st, n, br, fe = unpack(redis.call('HMGET', h, 'st', 'n', 'br', 'fe'))
  local o = prefix .. 'out:' .. id
  if not st then
    written[#written + 1] = 3
  elseif st ~= 'r' or n ~= want_n or (br or '') ~= router_ then
    written[#written + 1] = 0
  elseif tonumber(tok_at) > redis.call('STRLEN', o) then
    written[#written + 1] = 2
  else
    local t, l = prefix .. 'txt:' .. id, prefix .. 'lp:' .. id
    if toks ~= '' then redis.call('SETRANGE', o, tonumber(tok_at), toks) end
    if txt ~= '' then redis.call('SETRANGE', t, tonumber(txt_at), txt) end
    if lp ~= '' then redis.call('SETRANGE', l, tonumber(lp_at), lp) end
    local fields = {}   -- one HSET for the delta's stamps and its finish
    if ft ~= '' then fields[#fields + 1] = 'ft'; fields[#fields + 1] = ft end
    if fs ~= '' then fields[#fields + 1] = 'fs'; fields[#fields + 1] = fs end
    if ct ~= '' then fields[#fields + 1] = 'ct'; fields[#fields + 1] = ct end
    if toks ~= '' or txt ~= '' then
      tell_fronts_(fe, 'k', 'd', 'id', id, 'n', n, 'o', tok_at, 't', toks, 'xo', txt_at, 'x', txt,
        'lo', lp_at, 'l', lp, 'ft', ft, 'fs', fs, 'ct', ct)
    end
    if finished then
      for _, v in ipairs({'fr', ARGV[f + 9], 'err', ARGV[f + 10], 'rep', ARGV[f + 11],
          'fin', ARGV[f + 12], 'pre', ARGV[f + 13], 'st', 'f', 'q', '', 'o', '', 'br', ''}) do
        fields[#fields + 1] = v
      end
    end
    if #fields > 0 then redis.call('HSET', h, unpack(fields)) end
    if finished then
      redis.call('ZREM', prefix .. 'inflight', id)
      redis.call('SREM', prefix .. 'live', id)
      redis.call('EXPIRE', h, ttl)
      redis.call('EXPIRE', o, ttl)
      redis.call('EXPIRE', t, ttl)
      redis.call('EXPIRE', l, ttl)
      finish_event_(h, id, fe)
    end
    written[#written + 1] = 1
  end
end
return written
""")
STEP_PLAIN_ARGS = 6    # a plain delta's fields, after its 'p'
STEP_FULL_ARGS = 17    # a full delta's fields, after its 'f'
STEP_HOLE = 2          # its reply for a delta that starts past the recorded output
STEP_NO_RECORD = 3     # its reply for a delta of a request Redis holds no record of

# Stores again the record of a request this router runs, which Redis lost (a
# restart from an AOF fsynced once a second, a failover to a lagging replica
# dropped the writes that stored and leased it): the submit's fields, leased
# to the caller's replica under its assignment count, in the inflight and
# live sets; its output follows in a full-form STEP. A request that has a
# record is left as it is; one whose record ABANDON removed (its tombstone
# holds this submit token) is not stored again. The caller is named a front
# only if it is one; fronts left out (another router's clients) read the
# record back when they hear nothing of it (requests/remote.py) and are named
# again. Its queue member is made anew from its arrival (a requeue puts it
# back in arrival order).
# ARGV: prefix, then RESTORE_ITEM_ARGS per request: id, submit token,
#   digest, spec json, packed prompt ids, prompt length, max tokens,
#   priority, arrival, arrival (us), stream interval, replica, assignment
#   count, requeues, lease expiry, front (1: name the caller a front).
# -> 1 per request: 1 stored, 0 it had a record, 2 abandoned.
RESTORE = fenced("""
local prefix = ARGV[1]
local out = {}
for i = 2, #ARGV, 16 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  if redis.call('EXISTS', h) == 1 then
    out[#out + 1] = 0
  elseif redis.call('GET', prefix .. 'ab:' .. id) == ARGV[i + 1] then
    out[#out + 1] = 2
  else
    local fronts = ''
    if ARGV[i + 15] == '1' then fronts = router_ end
    local seq = redis.call('INCR', prefix .. 'seq')
    local member = string.format('%016d%012d:', tonumber(ARGV[i + 9]), seq) .. id
    redis.call('HSET', h, 'tok', ARGV[i + 1], 'd', ARGV[i + 2], 'sp', ARGV[i + 3],
      'p', ARGV[i + 4], 'pl', ARGV[i + 5], 'mt', ARGV[i + 6], 'pr', ARGV[i + 7],
      'at', ARGV[i + 8], 'si', ARGV[i + 10], 'q', '', 'm', member, 'seq', seq,
      'st', 'r', 'o', ARGV[i + 11], 'n', ARGV[i + 12], 'rq', ARGV[i + 13],
      'fe', fronts, 'br', router_, 'sat', now_, 'asg', now_, 'pat', now_,
      'ao', redis.call('INCR', prefix .. 'ao'))
    redis.call('ZADD', prefix .. 'inflight', ARGV[i + 14], id)
    redis.call('SADD', prefix .. 'live', id)
    out[#out + 1] = 1
  end
end
return out
""")
RESTORE_ITEM_ARGS = 16

# Ends requests that did not finish through a step (cancel, errors, requeue
# limit), queued or running; a finished one is left as it is. A request
# running on another router's replica is cancelled there ('c' to its back
# router); the other fronts get the finish.
# ARGV: prefix, ttl seconds, then 2 + 2k per request: id, k, then k
# field/value pairs for the hash.
FINISH = fenced(FINISH_EVENT + """
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
local i = 3
while i <= #ARGV do
  local id, k = ARGV[i], tonumber(ARGV[i + 1])
  local h = prefix .. 'req:' .. id
  local st, q, m, br, fe = unpack(redis.call('HMGET', h, 'st', 'q', 'm', 'br', 'fe'))
  if st and st ~= 'f' then
    if st == 'q' then redis.call('ZREM', prefix .. 'q:' .. q, m) end
    if st == 'r' and br and br ~= router_ and live_(br) then emit_(br, 'k', 'c', 'id', id) end
    local fields = {}   -- the caller's, then the finish's own (which win)
    for j = 1, 2 * k do fields[#fields + 1] = ARGV[i + 1 + j] end
    for _, v in ipairs({'st', 'f', 'q', '', 'o', '', 'br', ''}) do fields[#fields + 1] = v end
    redis.call('HSET', h, unpack(fields))
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('SREM', prefix .. 'live', id)
    redis.call('EXPIRE', h, ttl)
    redis.call('EXPIRE', prefix .. 'out:' .. id, ttl)
    redis.call('EXPIRE', prefix .. 'txt:' .. id, ttl)
    redis.call('EXPIRE', prefix .. 'lp:' .. id, ttl)
    finish_event_(h, id, fe)
  end
  i = i + 2 + 2 * k
end
return 1
""")

# Removes a request whose submit timed out at the router (its client was told
# UNAVAILABLE), if it is still the one that submit stored, so a retry with the
# same request_id starts it afresh. A pop may have taken it meanwhile; a
# replica of another router that was sent it is cancelled ('c'), and a
# tombstone holding the submit token (for the result TTL) tells that router's
# RESTORE the record was removed on purpose, not lost.
# ARGV: prefix, ttl seconds, then 2 per request: id, submit token.
ABANDON = fenced("""
local prefix, ttl = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local h = prefix .. 'req:' .. id
  local st, tok, q, m, br = unpack(redis.call('HMGET', h, 'st', 'tok', 'q', 'm', 'br'))
  if st and st ~= 'f' and tok == ARGV[i + 1] then
    if st == 'q' then redis.call('ZREM', prefix .. 'q:' .. q, m) end
    if st == 'r' then redis.call('SET', prefix .. 'ab:' .. id, tok, 'EX', ttl) end
    if st == 'r' and br and br ~= router_ and live_(br) then emit_(br, 'k', 'c', 'id', id) end
    redis.call('ZREM', prefix .. 'inflight', id)
    redis.call('DEL', h, prefix .. 'out:' .. id, prefix .. 'txt:' .. id, prefix .. 'lp:' .. id)
    redis.call('SREM', prefix .. 'live', id)
  end
end
return 1
""")
ABANDON_ITEM_ARGS = 2

# Sets in-flight leases: XX renews only what is still in flight (a live
# replica's requests).
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

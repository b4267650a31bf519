"""What every Lua script starts with: the router fence and the helpers that
reach other routers through their event streams.

The writer appends the calling router's id and epoch to every call. FENCE pops
them (so each script's own arguments keep their places) and refuses to run for
a router whose liveness lease has lapsed, or whose epoch is not the one
registered for its id: several routers share one Redis, and one that was cut
off must not overwrite what the others did meanwhile. The check is one GET:
P fence:<id> holds the router's epoch and expires with its lease (set with
the lease, lua_routers; never later than the lease's score in P routers, so a
router is fenced no later than the others count it dead). Leases are judged by
Redis's own clock, so routers' clocks need not agree. An empty router id (a
writer with no fence set: tools, tests of single scripts) is not checked.

Helpers (every script's ARGV[1] is the key prefix):
  live_(r)            router r holds a live lease
  emit_(r, ...)       XADD the field/value pairs to r's event stream
                      (P ev:<r>, MAXLEN ~ EVENTS_MAXLEN)
  fronts_of_(fe)      the routers holding a request's client streams, from its
                      'fe' field as read (ids separated by spaces)
  fronts_(h)          the same, read from request hash h
  other_fronts_of_(fe) the live ones other than the caller
  tell_fronts_(fe, .) emit_ to each of them
  kick_()             tell every other live router the shared queue has work
  record_(id)         a request as one flat list: its hash's field/value pairs,
                      then _out, _txt, _lp (its output so far)
A script that reads a request's hash anyway takes 'fe' in the same HMGET and
passes it on: every command a script runs costs Redis about a microsecond,
and these scripts run on every request's critical path
(benchmarks/router/script_lifecycle_cost.py).
"""

from __future__ import annotations

# A router that reads its stream this many events late has lost some: it sees a
# gap in a request's output offsets and reloads that request from Redis.
EVENTS_MAXLEN = 100_000

FENCE = """
local epoch_ = table.remove(ARGV)
local router_ = table.remove(ARGV)
local p_ = ARGV[1]
local t_ = redis.call('TIME')
local now_ = tonumber(t_[1]) + tonumber(t_[2]) / 1e6
if router_ ~= '' and redis.call('GET', p_ .. 'fence:' .. router_) ~= epoch_ then
  return redis.error_reply('FENCED router ' .. router_ .. ' epoch ' .. epoch_ .. ' holds no live lease')
end
local function live_(r)
  if (not r) or r == '' then return false end
  local e = redis.call('ZSCORE', p_ .. 'routers', r)
  return e ~= false and tonumber(e) >= now_
end
local function emit_(r, ...)
  redis.call('XADD', p_ .. 'ev:' .. r, 'MAXLEN', '~', %(maxlen)d, '*', ...)
end
local function fronts_of_(fe)
  local out = {}
  for r in string.gmatch(fe or '', '[^ ]+') do out[#out + 1] = r end
  return out
end
local function fronts_(h)
  return fronts_of_(redis.call('HGET', h, 'fe'))
end
local function other_fronts_of_(fe)
  local out = {}
  for _, r in ipairs(fronts_of_(fe)) do
    if r ~= router_ and live_(r) then out[#out + 1] = r end
  end
  return out
end
local function tell_fronts_(fe, ...)
  for _, r in ipairs(other_fronts_of_(fe)) do emit_(r, ...) end
end
local function kick_()
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', p_ .. 'routers', now_, '+inf')) do
    if r ~= router_ then emit_(r, 'k', 'q') end
  end
end
local function record_(id)
  local rec = redis.call('HGETALL', p_ .. 'req:' .. id)
  rec[#rec + 1] = '_out'
  rec[#rec + 1] = redis.call('GET', p_ .. 'out:' .. id) or ''
  rec[#rec + 1] = '_txt'
  rec[#rec + 1] = redis.call('GET', p_ .. 'txt:' .. id) or ''
  rec[#rec + 1] = '_lp'
  rec[#rec + 1] = redis.call('GET', p_ .. 'lp:' .. id) or ''
  return rec
end
""" % {"maxlen": EVENTS_MAXLEN}

# The event a finish sends to the request's other fronts (fe: its 'fe' field as
# read), read from its hash after the finish is recorded (so a finish from a
# step and one from FINISH look alike). Byte offsets say where the output
# ends: a front that has less reloads the request.
FINISH_EVENT = """
local function finish_event_(h, id, fe)
  local others = other_fronts_of_(fe)
  if #others == 0 then return end   -- the usual case: the caller is the only front
  local f = redis.call('HMGET', h, 'fr', 'err', 'rep', 'fin', 'pre', 'asg', 'rq', 'ft', 'fs', 'ct', 'n')
  for _, r in ipairs(others) do
    emit_(r, 'k', 'd', 'id', id, 'n', f[11] or '0',
      'o', redis.call('STRLEN', p_ .. 'out:' .. id), 't', '',
      'xo', redis.call('STRLEN', p_ .. 'txt:' .. id), 'x', '',
      'lo', redis.call('STRLEN', p_ .. 'lp:' .. id), 'l', '',
      'f', '1', 'fr', f[1] or '', 'err', f[2] or '', 'rep', f[3] or '', 'fin', f[4] or '',
      'pre', f[5] or '', 'asg', f[6] or '', 'rq', f[7] or '', 'ft', f[8] or '', 'fs', f[9] or '',
      'ct', f[10] or '')
  end
end
"""


# The fence key's expiry for a lease ending at Redis time `expiry` (seconds):
# whole milliseconds, rounded down.
FENCE_EXPIRY_MS = "math.floor(%s * 1000)"


def fenced(body: str) -> str:
    return FENCE + body

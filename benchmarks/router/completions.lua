-- wrk script: POST one non-streaming /v1/completions body on every connection, over and over.
--   wrk -t1 -c32 -d10s -s completions.lua http://HOST:PORT -- MAX_TOKENS MODEL PROMPT
-- Prints one line "WRK_JSON {...}" at the end: latency percentiles (microseconds), counts, errors
-- (errors.status counts responses with status 400 and above; no response() hook, so wrk stays lean).

local request_bytes

function init(args)
  local max_tokens = tonumber(args[1] or "1")
  local model = args[2] or "mock"
  local prompt = args[3] or "the router sends this prompt to a replica"
  -- peers.py passes a prompt of plain words: nothing in it needs JSON escaping.
  local body = string.format('{"model":"%s","prompt":"%s","max_tokens":%d,"temperature":0,"stream":false}',
                             model, prompt, max_tokens)
  request_bytes = wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"}, body)
end

function request()
  return request_bytes
end

function done(summary, latency, requests)
  local e = summary.errors
  local p = {}
  for _, q in ipairs({50, 90, 99, 99.9}) do
    p[#p + 1] = string.format('"%s":%d', tostring(q), latency:percentile(q))
  end
  io.write(string.format(
    'WRK_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"min":%d,"mean":%.1f,"max":%d,"stdev":%.1f,"percentiles":{%s}}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.max, latency.stdev, table.concat(p, ",")))
end

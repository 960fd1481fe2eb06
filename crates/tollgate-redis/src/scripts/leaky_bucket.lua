-- Leaky bucket as a pacer: the state is the tail of the queue, decimal
-- Unix ns (absent = fresh); computed as ns after now.
RATE.leaky_bucket = function(key, mode, cost, ttl, p)
  local interval = tonumber(p[1])
  local max_delay = tonumber(p[2])
  local limit = idiv(max_delay, interval) + 1
  local raw = get(key)
  local tat = since(raw)
  if not tat then
    if raw then redis.call('DEL', key) end
    tat = -FAR
  end
  local start = math.max(tat, 0)
  local reset = start
  -- Unit requests that could be admitted now with a queue ending at t >= now.
  local function remaining(t)
    if t > max_delay then return 0 end
    return idiv(max_delay - t, interval) + 1
  end
  if mode == 'refund' then return refund_tat(key, tat, interval * cost, ttl) end
  if cost == 0 then return {0, 0, limit, remaining(start), reset} end
  -- The wait of the request's own units (past 2^53 it is still > max_delay).
  local own = interval * (cost - 1)
  if own > max_delay then return {2, 0, limit, remaining(start), reset} end
  local delay = reset + own
  if delay > max_delay then
    return {1, delay - max_delay, limit, remaining(start), reset}
  end
  -- delay <= max_delay, so this is at most max_delay + interval.
  local nxt = delay + interval
  write(function() redis.call('SET', key, stamp(nxt), 'PX', ttl) end)
  return {0, delay, limit, remaining(nxt), nxt}
end

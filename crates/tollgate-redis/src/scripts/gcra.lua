-- GCRA: the state is the theoretical arrival time (TAT), decimal Unix ns
-- (absent = fresh); computed as ns after now.
RATE.gcra = function(key, mode, cost, ttl, p)
  local interval = tonumber(p[1])
  local burst = tonumber(p[2])
  local tau = interval * burst
  local raw = get(key)
  local tat = since(raw)
  if not tat then
    if raw then redis.call('DEL', key) end
    tat = -FAR
  end
  local start = math.max(tat, 0)
  local function remaining(t)
    if t >= tau then return 0 end
    return idiv(tau - t, interval)
  end
  if mode == 'refund' then return refund_tat(key, tat, interval * cost, ttl) end
  if cost == 0 then return {0, 0, burst, remaining(start), start} end
  if cost > burst then return {2, 0, burst, remaining(start), start} end
  -- cost <= burst: at most tau, and start is at most FAR.
  local nxt = start + interval * cost
  if nxt > tau then
    return {1, nxt - tau, burst, remaining(start), start}
  end
  write(function() redis.call('SET', key, stamp(nxt), 'PX', ttl) end)
  return {0, 0, burst, remaining(nxt), nxt}
end

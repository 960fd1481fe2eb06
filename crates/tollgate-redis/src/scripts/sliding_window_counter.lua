-- Sliding window counter: the state is a hash {start, current, previous},
-- the start of the current window (decimal Unix ns) and the counts of it
-- and of the window before (absent = all 0). The core keeps the window's
-- number since the epoch instead; the two decide alike.
RATE.sliding_window_counter = function(key, mode, cost, ttl, p)
  local limit = tonumber(p[1])
  local window = tonumber(p[2])
  local TWO53 = 9007199254740992
  -- floor(x × y / d) and the remainder, for integers x < 2^32 (a count),
  -- y >= 0 and 1 <= d < 2^53: exact even when the product passes 2^53 (a
  -- large limit over a long window), by long multiplication that keeps
  -- every intermediate below d.
  local function muldiv(x, y, d)
    local prod = x * y
    if prod < TWO53 then
      local q = idiv(prod, d)
      return q, prod - q * d
    end
    local yq = idiv(y, d)
    local yr = y - yq * d
    local q, r = 0, 0
    local rest, bit = x, 2147483648
    while bit >= 1 do
      -- (q, r) = 2 × (q, r)
      if r >= d - r then q, r = q * 2 + 1, r - (d - r) else q, r = q * 2, r * 2 end
      if rest >= bit then
        rest = rest - bit
        if r >= d - yr then q, r = q + 1, r - (d - yr) else r = r + yr end
      end
      bit = bit / 2
    end
    return x * yq + q, r
  end
  local _, phase = divnow(window)
  -- The state's window, as windows before now's (`shift`; nil = absent).
  local shift, current, previous, start = nil, 0, 0, nil
  local h = redis.pcall('HMGET', key, 'start', 'current', 'previous')
  if h.err then
    redis.call('DEL', key)
  else
    local at, c, prev = since(h[1]), count_of(h[2]), count_of(h[3])
    if at and c and prev then
      -- Both are window starts: an exact multiple of the window apart.
      shift, current, previous, start = idiv(-phase - at, window), c, prev, h[1]
    elseif h[1] or h[2] or h[3] then
      redis.call('DEL', key)
    end
  end
  if mode == 'refund' then
    if shift == 0 and current > 0 and cost > 0 then
      redis.call('HSET', key, 'current', math.max(0, current - cost))
      redis.call('PEXPIRE', key, ttl)
    end
    return {3, 0, 0, 0, 0}
  end
  -- Roll forward to now; a clock that went back reads as the start of the
  -- stored window (the previous window then weighs fully).
  if shift == nil or shift > 0 or (current == 0 and previous == 0) then
    if shift == 1 then previous = current else previous = 0 end
    current = 0
    shift = 0
    start = stamp(-phase)
  end
  local elapsed = 0
  if shift == 0 then elapsed = phase end
  local left = window - elapsed
  local function weighted(count)
    if count == 0 or left == 0 then return 0 end
    local q, r = muldiv(count, left, window)
    if r > 0 then q = q + 1 end
    return q
  end
  -- Elapsed time in a window at which ceil(count × (w − e) / w) <= room.
  local function elapsed_for(count, room)
    if count == 0 then return 0 end
    if room >= count then return 0 end
    local keep = muldiv(room, window, count)
    return math.max(0, window - keep)
  end
  local function reset_after(cur, prev)
    if cur > 0 then return left + window end
    if prev > 0 then return left end
    return 0
  end
  local used = weighted(previous) + current
  local remaining = math.max(0, limit - used)
  local reset = reset_after(current, previous)
  if cost == 0 then return {0, 0, limit, remaining, reset} end
  if cost > limit then return {2, 0, limit, remaining, reset} end
  if used + cost <= limit then
    current = current + cost
    write(function()
      redis.call('HSET', key, 'start', start, 'current', current, 'previous', previous)
      redis.call('PEXPIRE', key, ttl)
    end)
    return {0, 0, limit, math.max(0, remaining - cost), reset_after(current, previous)}
  end
  local retry
  if limit >= current + cost then
    -- The current window has room; wait for the previous to fade.
    retry = math.max(0, elapsed_for(previous, limit - current - cost) - elapsed)
  else
    -- Wait for the next window, where the current count fades in turn.
    retry = left + elapsed_for(current, math.max(0, limit - cost))
  end
  return {1, math.max(retry, 1), limit, remaining, reset}
end

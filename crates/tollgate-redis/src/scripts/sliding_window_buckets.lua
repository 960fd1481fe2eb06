-- Sliding window of buckets: the state is "index:c0,c1,...", the newest
-- bucket written, as its number since the Unix epoch, then the counts of
-- it and of the buckets before it, newest first (missing = 0; absent = a
-- fresh key). The core's SlidingWindowBuckets. Buckets are at least 1 ms,
-- so a bucket's number is exact (written with %.0f: whole, whatever its
-- size); counts are below 2^32.
RATE.sliding_window_buckets = function(key, mode, cost, ttl, p)
  local limit = tonumber(p[1])
  local bucket = tonumber(p[2])
  local n = tonumber(p[3])
  local stored, counts, held_any = nil, {}, false
  local raw = get(key)
  if raw then
    local s, list = string.match(raw, '^(%d+):([%d,]+)$')
    s = count_of(s)
    if s then
      for c in string.gmatch(list, '[^,]+') do
        local v = count_of(c)
        if not v or #counts >= n then s = nil break end
        counts[#counts + 1] = v
        if v > 0 then held_any = true end
      end
    end
    if s then stored = s else redis.call('DEL', key) end
  end
  local index, phase = divnow(bucket)
  -- The newest bucket (now's, or the stored one when the clock went
  -- back) and how far the stored counts shift to line up with it;
  -- nothing held reads as a fresh key.
  local newest, shift = index, n
  -- (A state more than 2^16 buckets ahead of the clock reads as fresh.)
  if stored and held_any and stored - index <= 65536 then
    if stored >= index then newest, shift = stored, 0 else shift = index - stored end
  end
  -- Writes the state: bucket `at`'s number, whole, and `list`'s counts.
  local function save(at, list)
    redis.call('SET', key, string.format('%.0f', at) .. ':' .. table.concat(list, ','), 'PX', ttl)
  end
  local function count(k)
    if k < shift then return 0 end
    return counts[k - shift + 1] or 0
  end
  if mode == 'refund' then
    if shift == 0 and (counts[1] or 0) > 0 and cost > 0 then
      counts[1] = math.max(0, counts[1] - cost)
      save(stored, counts)
    end
    return {3, 0, 0, 0, 0}
  end
  -- ns from now until bucket newest - k leaves the window.
  local function leaves(k) return (newest + n - k - index) * bucket - phase end
  local used, reset = 0, 0
  for k = 0, n - 1 do
    local c = count(k)
    if c > 0 and used == 0 then reset = leaves(k) end
    used = used + c
  end
  local remaining = math.max(0, limit - used)
  if cost == 0 then return {0, 0, limit, remaining, reset} end
  if cost > limit then return {2, 0, limit, remaining, reset} end
  if used + cost <= limit then
    local out = {count(0) + cost}
    for k = 1, n - 1 do out[k + 1] = count(k) end
    -- Trailing zeros are left out.
    while #out > 1 and out[#out] == 0 do out[#out] = nil end
    write(function() save(newest, out) end)
    return {0, 0, limit, remaining - cost, leaves(0)}
  end
  -- Wait until the oldest buckets have left enough room.
  local left = used
  for k = n - 1, 0, -1 do
    left = left - count(k)
    if left + cost <= limit then return {1, math.max(1, leaves(k)), limit, remaining, reset} end
  end
  return {1, 1, limit, remaining, reset}
end

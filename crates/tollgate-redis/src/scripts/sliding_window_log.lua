-- Sliding window log: the state is a list, [total, at1, cost1, at2,
-- cost2, ...]: the units held, then the admitted entries in the order
-- the core keeps them (oldest first, in time order: a request at or
-- before the newest entry joins it, so at most `limit` entries), their
-- times decimal Unix ns. Absent = empty. Entries are read on demand, so
-- one that does not parse is found late: guarded() then starts afresh.
RATE.sliding_window_log = function(key, mode, cost, ttl, p)
  local limit = tonumber(p[1])
  local window = tonumber(p[2])
  local function main()
    local len = redis.pcall('LLEN', key)
    if type(len) ~= 'number' then
      redis.call('DEL', key)
      len = 0
    end
    local total = 0
    if len > 0 then
      total = count_of(redis.call('LINDEX', key, 0))
      -- (A list of the header alone is never written: an empty log is deleted.)
      if not total or len < 3 or len % 2 ~= 1 then corrupt() end
    end
    local n = math.max(0, (len - 1) / 2)
    -- An entry as (ns after now, cost).
    local function parse(at, c)
      at, c = since(at), count_of(c)
      if not at or not c then corrupt() end
      return at, c
    end
    -- Entries read from the front on demand, in chunks; `base` entries have
    -- since been dropped from the front of the list.
    local ats, costs, loaded, base = {}, {}, 0, 0
    local function entry(i)
      if i > n then return nil end
      if i > loaded then
        local want = math.min(n, math.max(i, loaded * 2, 8))
        local raw = redis.call('LRANGE', key, 2 * (loaded - base) + 1, 2 * (want - base))
        for j = 1, #raw, 2 do
          loaded = loaded + 1
          ats[loaded], costs[loaded] = parse(raw[j], raw[j + 1])
        end
      end
      return ats[i], costs[i]
    end
    local function last()
      local raw = redis.call('LRANGE', key, -2, -1)
      return parse(raw[1], raw[2])
    end
    -- Writes the header, sets the TTL, or drops the key once empty.
    local function store(count)
      if count == 0 then
        redis.call('DEL', key)
      else
        redis.call('LSET', key, 0, total)
        redis.call('PEXPIRE', key, ttl)
      end
    end
    -- Drops the first `k` of the `all` entries the list holds now (the
    -- key, when that is all of them), the header first again.
    local function drop_first(k, all)
      if k == all then
        redis.call('DEL', key)
      else
        redis.call('LTRIM', key, 2 * k + 1, -1)
        redis.call('LPUSH', key, total)
      end
    end
    -- Drop the entries that left the window (those from the future, when the
    -- clock went back, stay), as the core does on every decision.
    local gone = 0
    while true do
      local at, c = entry(gone + 1)
      if at == nil or at + window > 0 then break end
      total = math.max(0, total - c)
      gone = gone + 1
    end
    if gone > 0 then
      drop_first(gone, n)
      base = gone
    end
    local count = n - gone
    if mode == 'refund' then
      -- As the core: give back the oldest units still in the window (the
      -- units kept leave last, so a refund never lets in more than giving
      -- back the request's own would). The list is [total, entries...].
      local left, full, partial = cost, 0, nil
      while left > 0 do
        local at, c = entry(gone + full + 1)
        if at == nil then break end
        local take = math.min(left, c)
        total = math.max(0, total - take)
        left = left - take
        if take == c then
          full = full + 1
        else
          partial = c - take
        end
      end
      if count > 0 and full > 0 then drop_first(full, count) end
      count = count - full
      if partial then redis.call('LSET', key, 2, partial) end
      if count > 0 then store(count) end
      return {3, 0, 0, 0, 0}
    end
    local function reset_after()
      if count == 0 then return 0 end
      local at = last()
      return math.max(0, at + window)
    end
    local remaining = math.max(0, limit - total)
    if cost == 0 then return {0, 0, limit, remaining, reset_after()} end
    if cost > limit then return {2, 0, limit, remaining, reset_after()} end
    if total + cost <= limit then
      -- As the core: a request made while the clock reads earlier than the
      -- newest entry joins it, so entries stay in time order. The newest
      -- entry then is that one, or the request's own, made now.
      local newest, c = 0, nil
      if count > 0 then
        local at, units = last()
        if at >= 0 then newest, c = at, units end
      end
      write(function()
        if c then
          redis.call('LSET', key, -1, c + cost)
        else
          if count == 0 then redis.call('RPUSH', key, '0') end
          redis.call('RPUSH', key, stamp(0), cost)
          count = count + 1
        end
        total = total + cost
        store(count)
      end)
      return {0, 0, limit, remaining - cost, newest + window}
    end
    -- Wait until enough of the oldest entries leave the window.
    local excess = total + cost - limit
    local freed, retry, i = 0, nil, gone + 1
    while true do
      local at, c = entry(i)
      if at == nil then break end
      freed = freed + c
      if freed >= excess then
        retry = math.max(0, at + window)
        break
      end
      i = i + 1
    end
    -- Unreachable (the entries hold the total): the core's u64::MAX.
    if retry == nil then retry = 9007199254740991 end
    return {1, math.max(retry, 1), limit, remaining, reset_after()}
  end
  return guarded(main, {key})
end

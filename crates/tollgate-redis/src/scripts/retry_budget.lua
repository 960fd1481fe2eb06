-- Retry budget, as tollgate_core::RetryBudget. KEYS[1] a hash of the
-- window's ten slots: field p ('0' to '9') holds the slot whose index is
-- p modulo 10, as "index deposited withdrawn" — the index, floor(now /
-- slot) + 1, and the thousandths of a retry deposited and withdrawn in
-- it (an absent field is the unused slot, index 0).
-- ARGV[1] the mode: 'deposit' (calls were made: ARGV[2] of them, at
-- least 1, all in the slot of now), 'withdraw' (a retry is wanted: one
-- retry if the balance has it), 'balance' (a read). ARGV[5]
-- the slot's length in ns (1 ms to 2.4 hours: a tenth of the window),
-- ARGV[6] the deposit per call (at most 10^6), ARGV[7] the floor over the
-- window (at most 8.64 * 10^13), both in thousandths of a retry.
-- The key's TTL (ARGV[4]) is the window plus a margin, set on every
-- write: a slot counts for at most a window after it was written, so the
-- state expires with its window. Refused withdrawals and reads write
-- nothing.
-- Reply: {granted (a withdrawal: 1 or 0; otherwise 1), the balance
-- after, in thousandths}.
-- Exact: the index is below 2^53 (slots of 1 ms or more; see divnow),
-- and each slot's counts are capped at 2^49, so that ten of them and the
-- floor add up exactly in doubles (the core saturates at 2^64 instead: a
-- difference only past 5 * 10^11 retries in one slot).
local SLOTS = 10
local UNIT = 1000
local CAP = 562949953421312
local FIELDS = {'0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local slot = tonumber(ARGV[5])
local deposit = tonumber(ARGV[6])
local reserve = tonumber(ARGV[7])
local key = KEYS[1]
-- Calls whose deposits this call carries (at most 2^20 at once).
local calls = math.min(count_of(ARGV[2]) or 0, 1048576)
local function fmt(n) return string.format('%.0f', n) end

local function main()
  local index = divnow(slot) + 1
  local oldest = index - (SLOTS - 1)
  local newest = index + (SLOTS - 1)
  local raw = redis.pcall('HMGET', key, unpack(FIELDS))
  if raw.err then
    redis.call('DEL', key)
    raw = {}
  end
  -- The slots by position, and the balance as RetryBudget::balance sums
  -- it: the floor, plus the slots in the window or later by less than a
  -- window (a clock a little ahead), less what they withdrew. A slot a
  -- whole window or more ahead (a clock far off) does not count.
  local slots = {}
  local deposited, withdrawn = reserve, 0
  for p = 0, SLOTS - 1 do
    local s = {0, 0, 0}
    local v = raw[p + 1]
    if v then
      local i, d, w = string.match(v, '^(%d+) (%d+) (%d+)$')
      i, d, w = count_of(i), count_of(d), count_of(w)
      if not (i and d and w) or i == 0 or i % SLOTS ~= p or d > CAP or w > CAP then
        corrupt()
      end
      s = {i, d, w}
    end
    slots[p] = s
    if s[1] ~= 0 and s[1] >= oldest and s[1] <= newest then
      deposited = deposited + s[2]
      withdrawn = withdrawn + s[3]
    end
  end
  local balance = math.max(0, deposited - withdrawn)

  -- Adds to now's slot, reset unless it is now's (another index at this
  -- position is a whole window or more away, either way).
  local function add(dep, wd)
    local p = index % SLOTS
    local s = slots[p]
    if s[1] ~= index then s = {index, 0, 0} end
    s[2] = math.min(CAP, s[2] + dep)
    s[3] = math.min(CAP, s[3] + wd)
    redis.call('HSET', key, FIELDS[p + 1], fmt(s[1]) .. ' ' .. fmt(s[2]) .. ' ' .. fmt(s[3]))
    redis.call('PEXPIRE', key, ttl)
  end

  if mode == 'deposit' then
    -- A ratio of 0 (the floor alone) deposits nothing: nothing to write.
    local dep = math.min(deposit * math.max(1, calls), CAP)
    if dep > 0 then
      add(dep, 0)
      balance = balance + dep
    end
    return {1, balance}
  elseif mode == 'withdraw' then
    if balance < UNIT then return {0, balance} end
    add(0, UNIT)
    return {1, balance - UNIT}
  end
  return {1, balance}
end
return guarded(main)

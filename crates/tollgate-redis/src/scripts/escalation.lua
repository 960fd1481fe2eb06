-- Escalation ladder, as tollgate_core::algorithm::Escalation. KEYS[1] a
-- string "strikes level since until": the strikes in the current period,
-- the blocks so far, when the period began and when the last block ends
-- (decimal Unix ns; '0' for none). Absent = a key with no history.
-- ARGV[1] the mode: 'check' (is the key blocked? writes nothing) or
-- 'strike' (a violation). ARGV[5] the strikes that block (at most 1000),
-- ARGV[6] the period, ARGV[7] the first block, ARGV[8] the longest block,
-- ARGV[9] how long after a block ends the key starts from the first step
-- again, all in ns (at most 2^51).
-- The key lives as long as it matters: until its period of strikes ends
-- or its last block is forgiven, whichever is later, plus a second.
-- Reply: {0, strikes, level} a strike counted short of a block; {1,
-- for_ns, level} the key is blocked for for_ns more (by this strike, or
-- already); {2, 0, level} a check that found no block.
local threshold = tonumber(ARGV[5])
local period = tonumber(ARGV[6])
local block = tonumber(ARGV[7])
local max_block = tonumber(ARGV[8])
local forgive = tonumber(ARGV[9])
local key = KEYS[1]

local function main()
  local strikes, level, since_d, until_d = 0, 0, nil, nil
  local raw = redis.pcall('GET', key)
  if type(raw) == 'table' and raw.err then
    redis.call('DEL', key)
  elseif type(raw) == 'string' then
    local a, b, c, d = string.match(raw, '^(%d+) (%d+) (%d+) (%d+)$')
    strikes, level = count_of(a), count_of(b)
    since_d, until_d = since(c), since(d)
    if not (strikes and level and since_d and until_d) then corrupt() end
  end
  local blocked = until_d ~= nil and until_d > 0
  if mode == 'check' then
    if blocked then return {1, until_d, level} end
    return {2, 0, level}
  end
  if blocked then return {1, until_d, level} end
  -- Out of trouble for long enough: back to the first step.
  if level > 0 and until_d ~= nil and -until_d >= forgive then level = 0 end
  if strikes == 0 or since_d == nil or -since_d >= period then
    strikes, since_d = 0, 0
  end
  strikes = strikes + 1
  local reply
  if strikes >= threshold then
    level = level + 1
    local dur = block
    for _ = 2, math.min(level, 64) do
      if dur >= max_block then break end
      dur = dur * 2
    end
    dur = math.min(dur, max_block)
    strikes, since_d, until_d = 0, 0, dur
    reply = {1, dur, level}
  else
    reply = {0, strikes, level}
  end
  local last = until_d or -FAR
  local lives = math.max(since_d + period, last + forgive, 0)
  local ttl_ms = ceildiv(lives, 1000000) + 1000
  local until_s = '0'
  if until_d ~= nil then until_s = stamp(until_d) end
  redis.call('SET', key, strikes .. ' ' .. level .. ' ' .. stamp(since_d) .. ' ' .. until_s,
    'PX', ttl_ms)
  return reply
end
return guarded(main)

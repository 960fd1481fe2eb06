-- Escalation ladder, as tollgate_core::algorithm::Escalation. KEYS[1] a
-- string "strikes level since until": the strikes in the current period,
-- the blocks so far, when the period began and when the last block ends
-- (decimal Unix ns; '0' for none). Absent = a key with no history.
-- ARGV[1] the mode: 'check' (is the key blocked? writes nothing) or
-- 'strike' (a violation). ARGV[5] the strikes that block (at most 1000),
-- ARGV[6] the period, ARGV[7] the first block, ARGV[8] the longest block,
-- ARGV[9] how long after a block ends the key starts from the first step
-- again, all in ns (at most 2^51). ARGV[10] a slowing ladder's number of
-- steps (0: the ladder blocks): its level is the step the key was put on,
-- until when that step's hold (ARGV[7]) ends, after which the key climbs
-- back one step per hold; a strike that is the last of its period puts
-- the key one step further down (at most the last) for a hold.
-- The key lives as long as it matters: until its period of strikes ends
-- or its last block is forgiven (its climb back ends), whichever is
-- later, plus a second.
-- Reply: {0, strikes, level} a strike counted short of a block; {1,
-- for_ns, level} the key is blocked for for_ns more (by this strike, or
-- already); {2, 0, level} a check that found no block (nor step); {3,
-- for_ns, level} the key is on step level, for for_ns more before it
-- climbs back one.
local threshold = tonumber(ARGV[5])
local period = tonumber(ARGV[6])
local block = tonumber(ARGV[7])
local max_block = tonumber(ARGV[8])
local forgive = tonumber(ARGV[9])
local steps = tonumber(ARGV[10] or '0')
local key = KEYS[1]

-- A slowing ladder's step in force and when it ends (relative ns), from
-- the step the key was put on and when its hold ends. A state left by a
-- ladder with more steps counts from this one's last.
local function in_force(level, until_d)
  level = math.min(level, steps)
  if level == 0 or until_d == nil then return 0, nil end
  if until_d > 0 then return level, until_d end
  local climbed = idiv(-until_d, block) + 1
  if climbed >= level then return 0, nil end
  return level - climbed, until_d + climbed * block
end

-- Counts a strike in the current period (a new one if it lapsed); true
-- when it is the last the period allows, which starts the next period.
local function counted(strikes, since_d)
  if strikes == 0 or since_d == nil or -since_d >= period then
    strikes, since_d = 0, 0
  end
  strikes = strikes + 1
  if strikes >= threshold then return true, 0, 0 end
  return false, strikes, since_d
end

local function save(strikes, level, since_d, until_d, lives)
  local ttl_ms = ceildiv(math.max(lives, 0), 1000000) + 1000
  local until_s = '0'
  if until_d ~= nil then until_s = stamp(until_d) end
  redis.call('SET', key, strikes .. ' ' .. level .. ' ' .. stamp(since_d) .. ' ' .. until_s,
    'PX', ttl_ms)
end

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
  if steps > 0 then
    level, until_d = in_force(level, until_d)
    if mode == 'check' then
      if level > 0 then return {3, until_d, level} end
      return {2, 0, 0}
    end
    local last
    last, strikes, since_d = counted(strikes, since_d)
    local reply = {0, strikes, level}
    if last then
      level, until_d = math.min(level + 1, steps), block
      reply = {3, block, level}
    end
    local climb = -FAR
    if level > 0 then climb = until_d + (level - 1) * block end
    save(strikes, level, since_d, until_d, math.max(since_d + period, climb))
    return reply
  end
  local blocked = until_d ~= nil and until_d > 0
  if mode == 'check' then
    if blocked then return {1, until_d, level} end
    return {2, 0, level}
  end
  if blocked then return {1, until_d, level} end
  -- Out of trouble for long enough: back to the first step.
  if level > 0 and until_d ~= nil and -until_d >= forgive then level = 0 end
  local last
  last, strikes, since_d = counted(strikes, since_d)
  local reply = {0, strikes, level}
  if last then
    level = level + 1
    local dur = block
    for _ = 2, math.min(level, 64) do
      if dur >= max_block then break end
      dur = dur * 2
    end
    dur = math.min(dur, max_block)
    until_d = dur
    reply = {1, dur, level}
  end
  save(strikes, level, since_d, until_d, math.max(since_d + period, (until_d or -FAR) + forgive))
  return reply
end
return guarded(main)

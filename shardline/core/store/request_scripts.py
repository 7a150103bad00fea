"""The Lua scripts RequestStore runs: each one a write that must be atomic, or safe to repeat."""

# KEYS: hash, prompt, active, recent. ARGV: id, arrival_ts, trim_before, prompt, field, value, ...
# One script so a duplicate id is refused atomically instead of overwriting a live request.
CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('SET', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[3])
return 1
"""

# KEYS: hash, prompt, tokens, logprobs, prompt logprobs, active. ARGV: id, retention_ms (0 unless
# finishing), field, value, ...
# Only a live request changes: a missing hash (unknown, or expired) is not
# resurrected as a fragment, and a terminal status is final, so a cancel that
# races a normal finish cannot overwrite it.
UPDATE_LIVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'finish_ts') == 1 then
  return 0
end
-- ARGV: request id, retention ms, n, then field/value pairs: the last n are set only if absent.
local last_set = #ARGV - 2 * tonumber(ARGV[3])
if last_set > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4, last_set)) end
for i = last_set + 1, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
local retention_ms = tonumber(ARGV[2])
if retention_ms > 0 then
  redis.call('SREM', KEYS[6], ARGV[1])
  for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], retention_ms) end
end
return 1
"""


# KEYS: per request, its tokens key then its logprobs key. ARGV: per request, the offset of its first
# new token, the new tokens packed, and how many serialized logprobs follow, then those.
# Appends by offset, so a step written again (a retry after a lost reply) never duplicates: whatever
# Redis already holds from that offset on is skipped. A gap is refused before anything is written,
# since appending after it would pair every later token with the wrong index.
APPEND_STEP_LUA = """
local requests, a = {}, 1
for i = 1, #KEYS, 2 do
  local offset, data, n = tonumber(ARGV[a]), ARGV[a + 1], tonumber(ARGV[a + 2])
  local have = redis.call('STRLEN', KEYS[i]) / 4
  if have < offset then
    return redis.error_reply('GAP ' .. KEYS[i] .. ' holds ' .. have .. ' tokens, the step starts at ' .. offset)
  end
  requests[#requests + 1] = {i, offset, data, n, a + 3, have}
  a = a + 3 + n
end
for _, r in ipairs(requests) do
  local i, offset, data, n, first, have = r[1], r[2], r[3], r[4], r[5], r[6]
  local skip = have - offset
  if skip * 4 < #data then redis.call('APPEND', KEYS[i], string.sub(data, skip * 4 + 1)) end
  if n > 0 then
    local held = redis.call('LLEN', KEYS[i + 1]) - offset
    for j = first + math.max(held, 0), first + n - 1 do redis.call('RPUSH', KEYS[i + 1], ARGV[j]) end
  end
end
return #requests
"""


# KEYS: a list. ARGV: its items. Sets the list unless it already exists.
SET_LIST_ONCE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 1, #ARGV, 1000 do redis.call('RPUSH', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
return 1
"""

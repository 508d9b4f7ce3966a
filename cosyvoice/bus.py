"""Every Redis key and command cosyvoice uses.

All keys of one session share the hash tag ``{SID}`` so the layout runs unchanged on
Redis Cluster. Updates that must be atomic are Lua scripts, each one round trip.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.typing import EncodableT, KeyT, StreamIdT

SESSIONS = "sessions"
WORKER_GROUP = "workers"
WORKERS = "workers"
WORKER_CAPACITY = "worker_capacity"
# A live worker's entry in WORKERS is dropped this long after its heartbeat lapsed.
WORKER_FORGET_MS = 60_000
# The keys the admission and placement scripts read, in their order.
CONTROL_KEYS = [SESSIONS, WORKERS, WORKER_CAPACITY]
# The announcement stream keeps this many entries (each is a few dozen bytes).
SESSIONS_MAXLEN = 10000


def audio_key(sid: str) -> str:
    return f"audio:{{{sid}}}"


def text_key(sid: str) -> str:
    """Both the result stream (replay) and the pub/sub channel (live)."""
    return f"text:{{{sid}}}"


def session_key(sid: str) -> str:
    return f"session:{{{sid}}}"


def lease_key(sid: str) -> str:
    return f"lease:{{{sid}}}"


def client_key(address: str) -> str:
    """Sorted set of one client address's sessions (score: when the slot lapses)."""
    return f"client:{address}"


def session_keys(sid: str) -> list[str]:
    return [session_key(sid), audio_key(sid), text_key(sid), lease_key(sid)]


def sid_from_channel(channel: str) -> str:
    return channel[channel.index("{") + 1:channel.rindex("}")]


# Checks the chunk's seq against the session's next_seq and appends it atomically.
# Returns {status, next_seq}: 0 appended, 1 duplicate, -1 no session, -3 gap,
# -4 the stream already ended.
_APPEND = """
local st = redis.call('HMGET', KEYS[1], 'next_seq', 'status')
if not st[1] then return {-1, 0} end
local nxt = tonumber(st[1])
local seq = tonumber(ARGV[1])
if seq < nxt then return {1, nxt} end
if st[2] ~= 'active' then return {-4, nxt} end
if seq > nxt then return {-3, nxt} end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'pb', ARGV[2])
redis.call('HSET', KEYS[1], 'next_seq', nxt + 1, 'rate', ARGV[4])
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'status', 'ended') end
return {0, nxt + 1}
"""

# Appends results to the replay stream and publishes each, but only while the session
# exists (a stopped session must not be recreated). KEYS: session, text, audio.
# ARGV: maxlen, ttl, checkpoint or '', done flag, results... The replay stream lives as
# long as a disconnected session, else ttl; a finished session's keys get ttl too, so a
# client that never disconnects leaves nothing behind. The published message is
# "<stream id> <json>", so clients can resume after an id.
_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ttl = redis.call('PTTL', KEYS[1])
for i = 5, #ARGV do
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[i])
  redis.call('PUBLISH', KEYS[2], id .. ' ' .. ARGV[i])
end
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) else redis.call('EXPIRE', KEYS[2], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'checkpoint', ARGV[3]) end
if ARGV[4] == '1' and ttl < 0 then
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[2]) end
end
return 1
"""

# Resume: the session's keys stop expiring and the new connection becomes its owner.
# KEYS: session, audio, text. ARGV: connection id. Returns the session hash, or {}.
_RESUME = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
for _, key in ipairs(KEYS) do redis.call('PERSIST', key) end
redis.call('HSET', KEYS[1], 'conn', ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""

# Disconnect: start the grace period, unless another connection has resumed the session
# since (possibly on another gateway). KEYS: session, audio, text. ARGV: conn, ms.
_RELEASE_CONN = """
if redis.call('HGET', KEYS[1], 'conn') ~= ARGV[1] then return 0 end
for _, key in ipairs(KEYS) do redis.call('PEXPIRE', key, ARGV[2]) end
return 1
"""

# One client address's session slots: drops lapsed ones, sets (or, with lapse 0, removes)
# this one's, refuses it past the limit (0 = no check), and lets the key expire with its
# newest slot. KEYS: client key. ARGV: now ms, session id, lapse ms, limit.
_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local ok = 1
if ARGV[3] == '0' then
  redis.call('ZREM', KEYS[1], ARGV[2])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  local limit = tonumber(ARGV[4])
  if limit > 0 and redis.call('ZCARD', KEYS[1]) > limit then
    redis.call('ZREM', KEYS[1], ARGV[2])
    ok = 0
  end
end
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if newest[2] then redis.call('PEXPIREAT', KEYS[1], newest[2]) end
return ok
"""

# Renews a lease its owner holds; 1 renewed, 0 not ours, -1 the session is gone.
_RENEW = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return -1
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# ---- the control plane: live workers, admission, placement -------------------------------
# These scripts take KEYS sessions, workers, worker_capacity, in that order. Liveness is
# judged by Redis's own clock (TIME), so hosts whose clocks differ agree on it. A worker's
# load is the number of announcements pending with it in the consumer group: it owns a
# session exactly while it holds that session's announcement, so the count changes in the
# same step as the ownership (XREADGROUP, XCLAIM, XACK) and is never stale.
#
# The decisions themselves are pure Lua functions of their arguments (RULES, no
# redis.call): tests/test_rules.py runs them in Lua 5.1, the version Redis embeds, without
# Redis. The scripts gather the inputs, call a rule, and carry out its answer.
RULES = """
-- Admission: the session may open while the open sessions are fewer than the live
-- workers' capacity. Returns admitted, capacity.
local function admits(open, caps)
  local capacity = 0
  for _, c in ipairs(caps) do capacity = capacity + c end
  return open < capacity, capacity
end
-- The least loaded other live worker with room (load / capacity): its load and capacity,
-- or nil when there is none.
local function least_loaded_other(me, ids, caps, load)
  local best_l, best_c
  for i, id in ipairs(ids) do
    local c, l = caps[i], load[id] or 0
    if id ~= me and c > 0 and l < c and (best_l == nil or l * best_c < best_l * c) then
      best_l, best_c = l, c
    end
  end
  return best_l, best_c
end
-- Whether a worker with `mine` of `mycap` sessions is the least loaded (ties take).
local function is_least(mine, mycap, best_l, best_c)
  return best_l == nil or mine * best_c <= best_l * mycap
end
-- Nothing can be placed: no orphan check asked for and nothing undelivered (age < 0).
local function nothing_to_place(orphan_ms, age)
  return orphan_ms == 0 and age < 0
end
-- How long a dead owner's session must have been idle before this worker claims it:
-- one lease past its owner's death, and `defer_ms` more unless this worker is the least
-- loaded.
local function orphan_idle_ms(orphan_ms, defer_ms, least)
  return orphan_ms + (least and 0 or defer_ms)
end
-- Whether this worker reads a new announcement: it is the least loaded, or the oldest
-- undelivered one has waited `defer_ms` (`age` is a function: only then is it asked).
local function takes_new(least, age, defer_ms)
  return least or (age() or -1) >= defer_ms
end
"""

_WORKERS_PRELUDE = RULES + """
local G = 'workers'
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function live_workers(now)
  local ids = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')
  local caps = {}
  if #ids > 0 then caps = redis.call('HMGET', KEYS[3], unpack(ids)) end
  for i = 1, #ids do caps[i] = tonumber(caps[i]) or 0 end
  return ids, caps
end
local function loads()
  local out = {}
  local p = redis.pcall('XPENDING', KEYS[1], G)
  if type(p) == 'table' and not p.err and type(p[4]) == 'table' then
    for _, c in ipairs(p[4]) do out[c[1]] = tonumber(c[2]) end
  end
  return out
end
"""

# The live workers: {id, capacity, load} flattened.
_LIVE_WORKERS = _WORKERS_PRELUDE + """
local ids, caps = live_workers(now_ms())
local load = loads()
local out = {}
for i, id in ipairs(ids) do
  out[#out + 1] = id; out[#out + 1] = caps[i]; out[#out + 1] = load[id] or 0
end
return out
"""

# Admission: announce the session only while the open sessions (announced and not ended)
# are fewer than the live workers' capacity, in one atomic step, so concurrent connects
# on any number of gateways never exceed it. ARGV: session id, stream maxlen.
# Returns {1, announcement id, capacity} or {0, open sessions, capacity}.
_ADMIT = _WORKERS_PRELUDE + """
local _, caps = live_workers(now_ms())
local open = redis.call('XLEN', KEYS[1])
local admitted, capacity = admits(open, caps)
if not admitted then return {0, open, capacity} end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'sid', ARGV[1])
return {1, id, capacity}
"""

# Placement: a worker takes sessions only while no other live worker with room is less
# loaded (load / capacity; ties take), one announcement at a time, so sessions spread
# evenly whether they come one by one or in a burst, from any number of gateways.
# Sessions whose owner died (pending, idle past ARGV[4] ms; 0 skips the check) come
# before new ones. A worker that is not the least loaded still takes an announcement
# that has waited ARGV[5] ms (or an orphan idle that much longer): the least loaded one
# may be busy with a long final, or dead with its heartbeat not yet lapsed.
# ARGV: worker id, its capacity, most sessions to take, orphan idle ms, defer ms.
# Returns {newest announcement id, {id, sid}, ...}.
_PLACE = _WORKERS_PRELUDE + """
local me, mycap = ARGV[1], tonumber(ARGV[2])
local free, orphan_ms, defer_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local function newest()
  local e = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  return e[1] and e[1][1] or '0-0'
end
-- Age of the oldest announcement no worker has taken; -1: none; nil: no group.
local function undelivered_age()
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  if groups.err then return nil end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == G then
      local e = redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+', 'COUNT', 1)
      if #e == 0 then return -1 end
      return now - tonumber(string.match(e[1][1], '^(%d+)'))
    end
  end
  return nil
end
local age = undelivered_age()
if age == nil then return redis.error_reply('NOGROUP the workers group is gone') end
-- Most rounds find nothing to place: answer those without reading every worker's load.
if nothing_to_place(orphan_ms, age) then return {newest()} end
local ids, caps = live_workers(now)
local load = loads()
local mine = load[me] or 0
local best_l, best_c = least_loaded_other(me, ids, caps, load)
local out = {}
while #out < free and mine < mycap do
  local first = is_least(mine, mycap, best_l, best_c)
  local got = {}
  if orphan_ms > 0 then
    local idle = orphan_idle_ms(orphan_ms, defer_ms, first)
    for _, p in ipairs(redis.call('XPENDING', KEYS[1], G, 'IDLE', idle, '-', '+', 10)) do
      if p[2] ~= me then
        got = redis.call('XCLAIM', KEYS[1], G, me, idle, p[1])
        break
      end
    end
  end
  if #got == 0 and takes_new(first, undelivered_age, defer_ms) then
    local r = redis.call('XREADGROUP', 'GROUP', G, me, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    if r then got = r[1][2] end
  end
  if #got == 0 then break end
  local e = got[1]
  if e[2] then
    out[#out + 1] = {e[1], e[2][2]}
    mine = mine + 1
  else
    redis.call('XACK', KEYS[1], G, e[1])  -- trimmed from the stream: nothing to own
  end
end
table.insert(out, 1, newest())
return out
"""

# Heartbeat: the worker is live until ARGV[3] ms from now with capacity ARGV[2]; workers
# whose heartbeat lapsed long ago are forgotten. KEYS: workers, worker_capacity.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[4]))
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('HDEL', KEYS[2], unpack(gone))
end
return 1
"""

# Deletes the named consumers from the group, each only while it holds no announcement
# (deleting one that does would drop those from the pending list, where nobody could take
# them over). KEYS: sessions. ARGV: consumer names. Returns how many were deleted.
_FORGET_CONSUMERS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], 'workers')
if not ok then return 0 end
local named = {}
for i = 1, #ARGV do named[ARGV[i]] = true end
local n = 0
for _, c in ipairs(consumers) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if named[info['name']] and tonumber(info['pending']) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], 'workers', info['name'])
    n = n + 1
  end
end
return n
"""


class AppendStatus:
    APPENDED = 0
    DUPLICATE = 1
    NO_SESSION = -1
    GAP = -3
    ENDED = -4


@dataclass(frozen=True)
class AppendResult:
    status: int
    next_seq: int


@dataclass(frozen=True)
class Admission:
    """The outcome of ``Bus.admit``: the announcement, or how full the service was."""

    admitted: bool
    announcement: str | None
    open_sessions: int | None
    capacity: int


@dataclass(frozen=True)
class Announcement:
    msg_id: str
    sid: str


def text(value: bytes | str) -> str:
    """A reply's string: this package's clients return bytes (no ``decode_responses``);
    redis-py's types also allow str."""
    return value.decode() if isinstance(value, bytes) else value


class _SingleWrite(redis.connection.AbstractConnection):
    """Mixed into a connection class (``_single_write``): sends a packed command or
    pipeline in one write.

    redis-py sends every argument over 6000 bytes (an audio chunk) as a write of its
    own, three per appended chunk; each write on a TCP socket is a system call and
    wakes Redis to parse a partial command.
    """

    def send_packed_command(self, command, check_health=True):
        if isinstance(command, list) and len(command) > 1:
            command = [b"".join(command)]
        return super().send_packed_command(command, check_health)


def _single_write(cls: type) -> type:
    return type(f"SingleWrite{cls.__name__}", (_SingleWrite, cls), {})


def connect(url: str, max_connections: int = 512, blocking: bool = True) -> redis.Redis:
    """A client whose pool waits for a free connection instead of failing at the cap."""
    pool_cls = redis.BlockingConnectionPool if blocking else redis.ConnectionPool
    kwargs = {"max_connections": max_connections}
    if blocking:
        kwargs["timeout"] = 10
    pool = pool_cls.from_url(url, health_check_interval=30, **kwargs)
    pool.connection_class = _single_write(pool.connection_class)
    return redis.Redis(connection_pool=pool)


class Bus:
    """Typed access to the Redis layout for the gateway and the worker."""

    def __init__(self, client: redis.Redis, stream_maxlen: int = 1000):
        self.r = client
        self.stream_maxlen = stream_maxlen
        self._append = client.register_script(_APPEND)
        self._publish = client.register_script(_PUBLISH)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._resume = client.register_script(_RESUME)
        self._release_conn = client.register_script(_RELEASE_CONN)
        self._slot = client.register_script(_SLOT)
        self._live = client.register_script(_LIVE_WORKERS)
        self._admit = client.register_script(_ADMIT)
        self._place = client.register_script(_PLACE)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._forget = client.register_script(_FORGET_CONSUMERS)

    # ---- gateway side -------------------------------------------------------------

    def create_session(self, sid: str, sample_rate: int, conn: str = "",
                       client: str = "", mode: str = "") -> None:
        """Write the session's hash; no worker hears of it until it is admitted."""
        self.r.hset(session_key(sid), mapping={
            "rate": sample_rate, "start_rate": sample_rate, "next_seq": 0,
            "status": "active", "created_ms": int(time.time() * 1000), "conn": conn,
            "client": client, "mode": mode})

    def admit(self, sid: str) -> Admission:
        """Announce a created session if the live workers have room for it, atomically
        (see ``_ADMIT``). The hash is written first, so no worker can see an
        announcement whose session does not exist yet."""
        reply = self._admit(keys=CONTROL_KEYS, args=[sid, SESSIONS_MAXLEN])
        if int(reply[0]) != 1:
            return Admission(False, None, int(reply[1]), int(reply[2]))
        announcement = reply[1].decode()
        self.r.hset(session_key(sid), "announcement", announcement)
        return Admission(True, announcement, None, int(reply[2]))

    def announce(self, sid: str) -> str:
        """Announce a session whatever the capacity: a hand-over, or a test's setup."""
        announcement = text(self.r.xadd(SESSIONS, {"sid": sid}, maxlen=SESSIONS_MAXLEN,
                                        approximate=True))
        self.r.hset(session_key(sid), "announcement", announcement)
        return announcement

    def open_sessions(self) -> int:
        """Sessions announced and not yet ended (claimed or waiting for a worker)."""
        return self.r.xlen(SESSIONS)

    def resume_session(self, sid: str, conn: str) -> dict[str, str]:
        """Make ``conn`` the session's connection and cancel its expiry; {} if gone."""
        flat = self._resume(keys=[session_key(sid), audio_key(sid), text_key(sid)], args=[conn])
        return {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}

    def release_connection(self, sid: str, conn: str, grace_s: float) -> bool:
        """Start the grace period if ``conn`` still owns the session."""
        return bool(self._release_conn(keys=[session_key(sid), audio_key(sid), text_key(sid)],
                                       args=[conn, int(grace_s * 1000)]))

    def claim_client_slot(self, client: str, sid: str, limit: int, hold_s: float) -> bool:
        """Count a session against its client address; False when the address is full."""
        if limit <= 0 or not client:
            return True
        return self._hold_slot(client, sid, hold_s, limit)

    def hold_client_slot(self, client: str, sid: str, seconds: float) -> None:
        """Keep the session's slot for ``seconds`` from now (e.g. a disconnect's grace)."""
        if client:
            self._hold_slot(client, sid, seconds, 0)

    def _hold_slot(self, client: str, sid: str, seconds: float, limit: int) -> bool:
        now_ms = int(time.time() * 1000)
        return bool(self._slot(keys=[client_key(client)],
                               args=[now_ms, sid, now_ms + int(seconds * 1000), limit]))

    def release_client_slot(self, client: str, sid: str) -> None:
        if client:
            self._slot(keys=[client_key(client)], args=[int(time.time() * 1000), sid, 0, 0])

    def append_chunks(self, items: list[tuple[str, int, bytes, int, bool]]) -> list:
        """Append (sid, seq, pb, rate, last) items in order with one round trip.

        Returns one ``AppendResult`` or exception per item.
        """
        replies = self._append_pipelined(items)
        missing = [i for i, r in enumerate(replies)
                   if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            # The server lost its script cache (restart, SCRIPT FLUSH): none of these
            # ran. Load the script and run them again, in their order.
            self._append.sha = self.r.script_load(self._append.script)
            again = self._append_pipelined([items[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return [r if isinstance(r, Exception) else AppendResult(int(r[0]), int(r[1]))
                for r in replies]

    def _append_pipelined(self, items: list[tuple[str, int, bytes, int, bool]]) -> list:
        # EVALSHA by hand: a pipeline given Script objects first asks the server
        # SCRIPT EXISTS, one more round trip before every batch of chunks is acked.
        pipe = self.r.pipeline(transaction=False)
        sha = self._append.sha
        for sid, seq, pb, rate, last in items:
            pipe.execute_command("EVALSHA", sha, 2, session_key(sid), audio_key(sid),
                                 seq, pb, self.stream_maxlen, rate, 1 if last else 0)
        return pipe.execute(raise_on_error=False)

    def session_info(self, sid: str) -> dict[str, str]:
        raw = self.r.hgetall(session_key(sid))
        return {text(k): text(v) for k, v in raw.items()}

    def delete_session(self, sid: str) -> None:
        """Delete every key of the session and its announcement (it no longer counts
        as open; its worker notices at its next lease renewal)."""
        announcement = self.r.hget(session_key(sid), "announcement")
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(*session_keys(sid))
        if announcement:
            pipe.xack(SESSIONS, WORKER_GROUP, announcement)
            pipe.xdel(SESSIONS, announcement)
        pipe.execute()

    def results_after(self, sid: str, after_id: str = "-", count: int = 1000):
        """Results stored after stream id ``after_id`` (exclusive), for replay."""
        start = "-" if after_id in ("", "-", None) else "(" + after_id
        return [(mid, fields[b"r"].decode())
                for mid, fields in self._xrange(text_key(sid), start, count)]

    def live_workers(self) -> list[dict]:
        """Workers whose heartbeat has not lapsed: ``{id, capacity, load}``, where load
        is the number of sessions the worker owns (announcements pending with it)."""
        flat = self._live(keys=CONTROL_KEYS)
        return [{"id": flat[i].decode(), "capacity": int(flat[i + 1]), "load": int(flat[i + 2])}
                for i in range(0, len(flat), 3)]

    # ---- worker side --------------------------------------------------------------

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(SESSIONS, WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def place(self, consumer: str, capacity: int, free: int, orphan_idle_ms: int,
              defer_ms: int) -> tuple[str, list[Announcement]]:
        """Take up to ``free`` sessions if this worker is the least loaded (``_PLACE``):
        those whose owner died (idle past ``orphan_idle_ms``; 0 skips them), then new
        ones. Returns the newest announcement id too, for ``wait_announcement``."""
        reply = self._place(keys=CONTROL_KEYS,
                            args=[consumer, capacity, free, orphan_idle_ms, defer_ms])
        return reply[0].decode(), [Announcement(mid.decode(), sid.decode())
                                   for mid, sid in reply[1:]]

    def wait_announcement(self, after_id: str, block_ms: int) -> bool:
        """Block until an announcement newer than ``after_id`` arrives (or the time is
        up): how an idle worker hears of a new session without polling."""
        return bool(self.r.xread({SESSIONS: after_id}, count=1, block=block_ms))

    def touch_announcements(self, consumer: str, msg_ids: list[str]) -> None:
        """Reset the idle time of announcements we own, so nobody claims them."""
        if msg_ids:
            ids: list[StreamIdT] = [*msg_ids]
            self.r.xclaim(SESSIONS, WORKER_GROUP, consumer, 0, ids, justid=True)

    def ack_announcement(self, msg_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(SESSIONS, WORKER_GROUP, msg_id)
        pipe.xdel(SESSIONS, msg_id)
        pipe.execute()

    def reannounce(self, sid: str, old_msg_id: str) -> None:
        """Hand a session to the next free worker at once (graceful shutdown)."""
        self.announce(sid)
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(SESSIONS, WORKER_GROUP, old_msg_id)
        pipe.xdel(SESSIONS, old_msg_id)
        pipe.execute()

    def take_lease(self, sid: str, worker_id: str, ttl_ms: int) -> bool:
        return bool(self.r.set(lease_key(sid), worker_id, nx=True, px=ttl_ms))

    def renew_leases(self, sids: list[str], worker_id: str, ttl_ms: int) -> dict[str, int]:
        """Renew every lease in one round trip; 1 kept, 0 lost, -1 session gone."""
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            self._renew(keys=[lease_key(sid), session_key(sid)], args=[worker_id, ttl_ms],
                        client=pipe)
        return dict(zip(sids, (int(x) for x in pipe.execute()), strict=True)) if sids else {}

    def release_lease(self, sid: str, worker_id: str) -> None:
        self._release(keys=[lease_key(sid)], args=[worker_id])

    def read_audio(self, positions: dict[str, str], count: int, block_ms: int | None):
        """New audio entries of each session after its position: {sid: [(id, pb)]}."""
        streams: dict[KeyT, StreamIdT] = {audio_key(sid): pos for sid, pos in positions.items()}
        # redis-py types the reply for every protocol and decoding mode; this client's
        # is RESP2 bytes: [(key, [(id, {field: value})])].
        reply: Any = self.r.xread(streams, count=count, block=block_ms)
        out: dict[str, list[tuple[str, bytes]]] = {}
        for key, entries in reply or []:
            sid = sid_from_channel(key.decode())
            out[sid] = [(mid.decode(), fields[b"pb"]) for mid, fields in entries]
        return out

    def _xrange(self, key: str, start: str, count: int) -> list[tuple[str, dict[bytes, bytes]]]:
        """XRANGE to the end as this package's clients return it (RESP2, bytes)."""
        reply: Any = self.r.xrange(key, start, "+", count=count)
        return [(mid.decode(), fields) for mid, fields in reply or []]

    def publish_results(self, sid: str, results: list[dict], ttl_s: int,
                        checkpoint: dict | None = None, done: bool = False) -> bool:
        """Store and publish results; False when the session no longer exists."""
        if not results and checkpoint is None and not done:
            return True
        args: list[EncodableT] = [self.stream_maxlen, ttl_s,
                                  json.dumps(checkpoint) if checkpoint else "", 1 if done else 0]
        args += [json.dumps(r, separators=(",", ":")) for r in results]
        return bool(self._publish(keys=[session_key(sid), text_key(sid), audio_key(sid)],
                                  args=args))

    def heartbeat(self, worker_id: str, capacity: int, ttl_ms: int) -> None:
        """The worker is live for ``ttl_ms`` more, with room for ``capacity`` sessions."""
        self._heartbeat(keys=[WORKERS, WORKER_CAPACITY],
                        args=[worker_id, capacity, ttl_ms, WORKER_FORGET_MS])

    # ---- sweeper ------------------------------------------------------------------------

    def try_lock(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.r.set(name, owner, nx=True, px=ttl_ms))

    def announcements(self, after: str = "-", count: int = 500) -> list[Announcement]:
        start = "-" if after == "-" else "(" + after
        return [Announcement(mid, fields.get(b"sid", b"").decode())
                for mid, fields in self._xrange(SESSIONS, start, count)]

    def last_activity_ms(self, sids: list[str]) -> dict[str, int | None]:
        """Time of each session's newest audio entry (or its creation); None if gone."""
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.xrevrange(audio_key(sid), "+", "-", count=1)
            pipe.hget(session_key(sid), "created_ms")
        replies = pipe.execute()
        out: dict[str, int | None] = {}
        for i, sid in enumerate(sids):
            entries, created = replies[2 * i], replies[2 * i + 1]
            if entries:
                out[sid] = int(entries[0][0].decode().split("-")[0])
            elif created is not None:
                out[sid] = int(created)
            else:
                out[sid] = None
        return out

    def sweep_session(self, sid: str, msg_id: str) -> None:
        """Delete an abandoned session: trim its streams first, then every key."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xtrim(audio_key(sid), maxlen=0)
        pipe.xtrim(text_key(sid), maxlen=0)
        pipe.delete(*session_keys(sid))
        pipe.xack(SESSIONS, WORKER_GROUP, msg_id)
        pipe.xdel(SESSIONS, msg_id)
        pipe.execute()

    def remove_worker(self, worker_id: str) -> None:
        """A stopping worker leaves: no longer live, its consumer forgotten once empty."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(WORKERS, worker_id)
        pipe.hdel(WORKER_CAPACITY, worker_id)
        pipe.execute()
        self.forget_consumers([worker_id])

    def dead_consumers(self) -> list[str]:
        """Consumers of the group that are not live workers (killed or stopped ones)."""
        try:
            consumers = self.r.xinfo_consumers(SESSIONS, WORKER_GROUP)
        except redis.ResponseError:
            return []  # no stream or group yet
        live = {w["id"] for w in self.live_workers()}
        return [c["name"].decode() for c in consumers if c["name"].decode() not in live]

    def forget_consumers(self, names: list[str]) -> int:
        """Delete these consumers from the group, each only if it holds no announcement."""
        return int(self._forget(keys=[SESSIONS], args=names)) if names else 0

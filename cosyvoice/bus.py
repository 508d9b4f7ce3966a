"""Every Redis key and command cosyvoice uses.

All keys of one session share the hash tag ``{SID}`` so the layout runs unchanged on
Redis Cluster. Multi-step updates are Lua scripts, so each is one atomic round trip.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

SESSIONS = "sessions"
WORKER_GROUP = "workers"
WORKERS = "workers"
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


def worker_key(worker_id: str) -> str:
    return f"worker:{worker_id}"


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
class Announcement:
    msg_id: str
    sid: str


class _SingleWrite:
    """Sends a packed command or pipeline in one write.

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

    # ---- gateway side -------------------------------------------------------------

    def create_session(self, sid: str, sample_rate: int, conn: str = "",
                       client: str = "", mode: str = "") -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(session_key(sid), mapping={
            "rate": sample_rate, "start_rate": sample_rate, "next_seq": 0,
            "status": "active", "created_ms": int(time.time() * 1000), "conn": conn,
            "client": client, "mode": mode})
        pipe.xadd(SESSIONS, {"sid": sid}, maxlen=SESSIONS_MAXLEN, approximate=True)
        announcement = pipe.execute()[1]
        self.r.hset(session_key(sid), "announcement", announcement)

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
        missing = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            # The server lost its script cache (restart, SCRIPT FLUSH): none of these
            # ran. Load the script and run them again, in their order.
            self._append.sha = self.r.script_load(self._append.script)
            for i, reply in zip(missing, self._append_pipelined([items[i] for i in missing])):
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
        return {k.decode(): v.decode() for k, v in raw.items()}

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
        return [(mid.decode(), fields[b"r"].decode())
                for mid, fields in self.r.xrange(text_key(sid), start, "+", count=count)]

    def live_workers(self) -> list[dict]:
        """Workers whose heartbeat has not lapsed, with their load and capacity."""
        now_ms = int(time.time() * 1000)
        ids = [i.decode() for i in self.r.zrangebyscore(WORKERS, now_ms, "+inf")]
        if not ids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for wid in ids:
            pipe.hgetall(worker_key(wid))
        out = []
        for wid, info in zip(ids, pipe.execute()):
            if info:
                out.append({"id": wid, **{k.decode(): int(v) for k, v in info.items()}})
        return out

    # ---- worker side --------------------------------------------------------------

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(SESSIONS, WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def claim_new(self, consumer: str, count: int, block_ms: int | None) -> list[Announcement]:
        reply = self.r.xreadgroup(WORKER_GROUP, consumer, {SESSIONS: ">"}, count=count,
                                  block=block_ms)
        return [Announcement(mid.decode(), fields[b"sid"].decode())
                for _stream, entries in (reply or []) for mid, fields in entries if fields]

    def claim_abandoned(self, consumer: str, min_idle_ms: int, count: int) -> list[Announcement]:
        """Announcements whose consumer has not touched them for ``min_idle_ms``."""
        reply = self.r.xautoclaim(SESSIONS, WORKER_GROUP, consumer, min_idle_ms,
                                  start_id="0-0", count=count)
        entries = reply[1] if reply else []
        return [Announcement(mid.decode(), fields[b"sid"].decode())
                for mid, fields in entries if fields]

    def touch_announcements(self, consumer: str, msg_ids: list[str]) -> None:
        """Reset the idle time of announcements we own, so nobody claims them."""
        if msg_ids:
            self.r.xclaim(SESSIONS, WORKER_GROUP, consumer, 0, msg_ids, justid=True)

    def ack_announcement(self, msg_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(SESSIONS, WORKER_GROUP, msg_id)
        pipe.xdel(SESSIONS, msg_id)
        pipe.execute()

    def reannounce(self, sid: str, old_msg_id: str) -> None:
        """Hand a session to the next free worker at once (graceful shutdown)."""
        new_id = self.r.xadd(SESSIONS, {"sid": sid}, maxlen=SESSIONS_MAXLEN, approximate=True)
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(SESSIONS, WORKER_GROUP, old_msg_id)
        pipe.xdel(SESSIONS, old_msg_id)
        pipe.hset(session_key(sid), "announcement", new_id)
        pipe.execute()

    def take_lease(self, sid: str, worker_id: str, ttl_ms: int) -> bool:
        return bool(self.r.set(lease_key(sid), worker_id, nx=True, px=ttl_ms))

    def renew_leases(self, sids: list[str], worker_id: str, ttl_ms: int) -> dict[str, int]:
        """Renew every lease in one round trip; 1 kept, 0 lost, -1 session gone."""
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            self._renew(keys=[lease_key(sid), session_key(sid)], args=[worker_id, ttl_ms],
                        client=pipe)
        return dict(zip(sids, (int(x) for x in pipe.execute()))) if sids else {}

    def release_lease(self, sid: str, worker_id: str) -> None:
        self._release(keys=[lease_key(sid)], args=[worker_id])

    def read_audio(self, positions: dict[str, str], count: int, block_ms: int | None):
        """New audio entries of each session after its position: {sid: [(id, pb)]}."""
        streams = {audio_key(sid): pos for sid, pos in positions.items()}
        reply = self.r.xread(streams, count=count, block=block_ms)
        out: dict[str, list[tuple[str, bytes]]] = {}
        for key, entries in reply or []:
            sid = sid_from_channel(key.decode())
            out[sid] = [(mid.decode(), fields[b"pb"]) for mid, fields in entries]
        return out

    def publish_results(self, sid: str, results: list[dict], ttl_s: int,
                        checkpoint: dict | None = None, done: bool = False) -> bool:
        """Store and publish results; False when the session no longer exists."""
        if not results and checkpoint is None and not done:
            return True
        args = [self.stream_maxlen, ttl_s, json.dumps(checkpoint) if checkpoint else "",
                1 if done else 0]
        args += [json.dumps(r, separators=(",", ":")) for r in results]
        return bool(self._publish(keys=[session_key(sid), text_key(sid), audio_key(sid)],
                                  args=args))

    def heartbeat(self, worker_id: str, load: int, capacity: int, ttl_ms: int) -> None:
        now_ms = int(time.time() * 1000)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(worker_key(worker_id), mapping={"load": load, "capacity": capacity})
        pipe.pexpire(worker_key(worker_id), ttl_ms)
        pipe.zadd(WORKERS, {worker_id: now_ms + ttl_ms})
        pipe.zremrangebyscore(WORKERS, "-inf", now_ms - 60_000)
        pipe.execute()

    # ---- sweeper ------------------------------------------------------------------------

    def try_lock(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.r.set(name, owner, nx=True, px=ttl_ms))

    def announcements(self, after: str = "-", count: int = 500) -> list[Announcement]:
        start = "-" if after == "-" else "(" + after
        return [Announcement(mid.decode(), fields.get(b"sid", b"").decode())
                for mid, fields in self.r.xrange(SESSIONS, start, "+", count=count)]

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
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(WORKERS, worker_id)
        pipe.delete(worker_key(worker_id))
        pipe.execute()

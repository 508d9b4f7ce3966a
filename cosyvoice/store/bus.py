"""The Redis layer's API: every Redis command cosyvoice sends goes through ``Bus``, but for
the gateway's result subscriptions, which its relay reads on pub/sub connections of its
own (``cosyvoice/gateway/relay.py``: one per process, or one per primary of a cluster).

The key names are ``keys.py``'s; updates that must be atomic are Lua scripts, one round
trip each, in ``cosyvoice/store/lua/`` (``scripts.py`` reads them). ``connect`` (the
client, one Redis or a cluster) is ``connection.py``'s and the shapes of its answers
``replies.py``'s, named here too.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.typing import EncodableT, KeyT, StreamIdT

from ..wire import messages
from ..wire.messages import Checkpoint, Published
from . import scripts
from .connection import connect, credentials
from .keys import (
    CLUSTER_CONTROL,
    CONTROL,
    SESSIONS_MAXLEN,
    USAGE_TTL_S,
    WORKER_FORGET_MS,
    WORKER_GROUP,
    audio_key,
    client_key,
    face_key,
    lease_key,
    session_key,
    session_keys,
    sid_from_channel,
    text_key,
    usage_key,
)
from .replies import Admission, Announcement, AppendResult, AppendStatus, text

__all__ = ["Admission", "Announcement", "AppendResult", "AppendStatus", "Bus", "connect",
           "credentials", "text"]

# The drain rate counts the sessions that ended in this many seconds, at most ENDS_KEPT.
DRAIN_WINDOW_S = 120
ENDS_KEPT = 200

# On a cluster, a worker that found no audio asks again after this long (a blocking XREAD
# would wait on one node only).
CLUSTER_POLL_MS = 10


def _raised(reply: Any) -> Any:
    """A pipelined reply, or the exception it carries raised."""
    if isinstance(reply, Exception):
        raise reply
    return reply


class Bus:
    """Typed access to the Redis layout for the gateway and the worker."""

    def __init__(self, client: redis.Redis, stream_maxlen: int = 1000):
        self.r = client
        self.stream_maxlen = stream_maxlen
        # On a Redis Cluster (``connect(cluster=True)``): control keys with one hash tag,
        # results on sharded pub/sub, and no command over keys of several slots
        self.cluster = isinstance(client, RedisCluster)
        self.k = CLUSTER_CONTROL if self.cluster else CONTROL
        self._append = client.register_script(scripts.APPEND)
        self._publish = client.register_script(scripts.SPUBLISH if self.cluster
                                               else scripts.PUBLISH)
        self._renew = client.register_script(scripts.RENEW)
        self._release = client.register_script(scripts.RELEASE)
        self._resume = client.register_script(scripts.RESUME)
        self._note_announcement = client.register_script(scripts.NOTE_ANNOUNCEMENT)
        self._release_conn = client.register_script(scripts.RELEASE_CONN)
        self._touch = client.register_script(scripts.TOUCH)
        self._slot = client.register_script(scripts.SLOT)
        self._live = client.register_script(scripts.LIVE_WORKERS)
        self._admit = client.register_script(scripts.ADMIT)
        self._place = client.register_script(scripts.PLACE)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._forget = client.register_script(scripts.FORGET_CONSUMERS)

    def ping(self) -> None:
        """Raises unless Redis answers: on a cluster, every primary."""
        if self.cluster:
            self.r.ping(target_nodes=RedisCluster.PRIMARIES)
        else:
            self.r.ping()

    # ---- gateway side -------------------------------------------------------------

    def create_session(self, sid: str, sample_rate: int, conn: str = "",
                       client: str = "", mode: str = "",
                       options: Mapping[str, str] | None = None) -> None:
        """Write the session's hash; no worker hears of it until it is admitted.
        ``options``: the session's settings its worker reads (``language``, ``script``,
        ``format``: cosyvoice/text/stages.py)."""
        fields: dict[EncodableT, EncodableT] = {
            "rate": sample_rate, "start_rate": sample_rate, "next_seq": 0,
            "status": "active", "created_ms": int(time.time() * 1000), "conn": conn,
            "client": client, "mode": mode}
        fields.update(options or {})
        self.r.hset(session_key(sid), mapping=fields)

    def admit(self, sid: str) -> Admission:
        """Announce a created session if the live workers have room for it, atomically
        (see ``lua/admit.lua``). The hash is written first, so no worker can see an
        announcement whose session does not exist yet."""
        reply = self._admit(keys=self.k.all, args=[sid, SESSIONS_MAXLEN])
        if int(reply[0]) != 1:
            return Admission(False, None, int(reply[1]), int(reply[2]))
        announcement = reply[1].decode()
        self._note(sid, announcement)
        return Admission(True, announcement, None, int(reply[2]))

    def announce(self, sid: str) -> str:
        """Announce a session whatever the capacity: a hand-over, or a test's setup."""
        announcement = text(self.r.xadd(self.k.sessions, {"sid": sid}, maxlen=SESSIONS_MAXLEN,
                                        approximate=True))
        self._note(sid, announcement)
        return announcement

    def _note(self, sid: str, announcement: str) -> None:
        """Record the announcement in the session's hash, unless the session is gone by
        now (its announcement then names nothing: the worker that gets it acks it)."""
        self._note_announcement(keys=[session_key(sid)], args=[announcement])

    def open_sessions(self) -> int:
        """Sessions announced and not yet ended (claimed or waiting for a worker)."""
        return self.r.xlen(self.k.sessions)

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
        # EVALSHA by hand: a pipeline given Script objects first asks the server
        # SCRIPT EXISTS, one more round trip before every batch of chunks is acked.
        replies = self._evalsha_pipelined(self._append, [
            ([session_key(sid), audio_key(sid)],
             [seq, pb, self.stream_maxlen, rate, 1 if last else 0])
            for sid, seq, pb, rate, last in items])
        return [r if isinstance(r, Exception) else AppendResult(int(r[0]), int(r[1]))
                for r in replies]

    def _delete_keys(self, pipe: Any, keys: list[str]) -> None:
        """DEL of keys of one slot in a pipeline (a cluster pipeline takes one key a DEL)."""
        if self.cluster:
            for key in keys:
                pipe.delete(key)
        else:
            pipe.delete(*keys)

    def _evalsha_pipelined(self, script: Script,
                           calls: list[tuple[list[KeyT], list[EncodableT]]]) -> list:
        """Run ``script`` once per (keys, args) in one pipeline, in order; a reply or an
        exception each. Where a server lost its script cache (a restart, SCRIPT FLUSH;
        on a cluster each node has its own), the script is loaded and the calls that did
        not run are sent again, in their order."""
        replies = self._evalsha_once(script.sha, calls)
        missing = [i for i, r in enumerate(replies)
                   if isinstance(r, redis.exceptions.NoScriptError)]
        if missing:
            script.sha = text(self.r.script_load(script.script))
            again = self._evalsha_once(script.sha, [calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    def _evalsha_once(self, sha: str, calls: list[tuple[list[KeyT], list[EncodableT]]]) -> list:
        pipe = self.r.pipeline(transaction=False)
        for keys, args in calls:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        return pipe.execute(raise_on_error=False)

    def session_info(self, sid: str) -> dict[str, str]:
        raw = self.r.hgetall(session_key(sid))
        return {text(k): text(v) for k, v in raw.items()}

    def delete_session(self, sid: str) -> None:
        """Delete every key of the session and its announcement (it no longer counts
        as open; its worker notices at its next lease renewal)."""
        announcement = self.r.hget(session_key(sid), "announcement")
        pipe = self.r.pipeline(transaction=False)
        self._delete_keys(pipe, session_keys(sid))
        if announcement:
            pipe.xack(self.k.sessions, WORKER_GROUP, announcement)
            pipe.xdel(self.k.sessions, announcement)
            self._ended(pipe)
        pipe.execute()

    def results_after(self, sid: str, after_id: str = "-"):
        """Every result stored after stream id ``after_id`` (exclusive), for replay: as
        many as the stream keeps (``stream_maxlen``, or more with approximate trimming)."""
        start = "-" if after_id in ("", "-", None) else "(" + after_id
        return [(mid, fields[b"r"].decode())
                for mid, fields in self._xrange(text_key(sid), start, None)]

    def live_workers(self) -> list[dict]:
        """Workers whose heartbeat has not lapsed: ``{id, capacity, load}``, where load
        is the number of sessions the worker owns (announcements pending with it)."""
        flat = self._live(keys=self.k.all)
        return [{"id": flat[i].decode(), "capacity": int(flat[i + 1]), "load": int(flat[i + 2])}
                for i in range(0, len(flat), 3)]

    # ---- worker side --------------------------------------------------------------

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.k.sessions, WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def place(self, consumer: str, capacity: int, free: int, orphan_idle_ms: int,
              defer_ms: int) -> tuple[str, list[Announcement]]:
        """Take up to ``free`` sessions if this worker is the least loaded (``lua/place.lua``):
        those whose owner died (idle past ``orphan_idle_ms``; 0 skips them), then new
        ones. Returns the newest announcement id too, for ``wait_announcement``."""
        reply = self._place(keys=self.k.all,
                            args=[consumer, capacity, free, orphan_idle_ms, defer_ms])
        return reply[0].decode(), [Announcement(mid.decode(), sid.decode())
                                   for mid, sid in reply[1:]]

    def wait_announcement(self, after_id: str, block_ms: int) -> bool:
        """Block until an announcement newer than ``after_id`` arrives (or the time is
        up): how an idle worker hears of a new session without polling."""
        return bool(self.r.xread({self.k.sessions: after_id}, count=1, block=block_ms))

    def touch_announcements(self, consumer: str, msg_ids: list[str]) -> None:
        """Reset the idle time of announcements we own, so nobody claims them."""
        if msg_ids:
            ids: list[StreamIdT] = [*msg_ids]
            self.r.xclaim(self.k.sessions, WORKER_GROUP, consumer, 0, ids, justid=True)

    def ack_announcement(self, msg_id: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(self.k.sessions, WORKER_GROUP, msg_id)
        pipe.xdel(self.k.sessions, msg_id)
        self._ended(pipe)
        pipe.execute()

    def _ended(self, pipe) -> None:
        """Record that a session ended (an open place freed) for the drain rate."""
        now_ms = int(time.time() * 1000)
        pipe.zadd(self.k.ended, {f"{now_ms}-{uuid.uuid4().hex[:8]}": now_ms})
        pipe.zremrangebyrank(self.k.ended, 0, -ENDS_KEPT - 1)

    def drain_rate(self) -> float | None:
        """Sessions ended per second over the last ``DRAIN_WINDOW_S`` (the latest
        ``ENDS_KEPT`` ends at most); None: fewer than two ends in that time."""
        now_ms = time.time() * 1000
        ends = self.r.zrangebyscore(self.k.ended, now_ms - DRAIN_WINDOW_S * 1000, "+inf",
                                    withscores=True)
        if len(ends) < 2:
            return None
        span_s = max(1.0, (now_ms - float(ends[0][1])) / 1000)
        return len(ends) / span_s

    def worker_loads(self, ids: list[str]) -> dict[str, dict]:
        """The reported loads of the workers ``ids`` (those that reported one)."""
        if not ids:
            return {}
        raw = self.r.hmget(self.k.worker_load, ids)
        return {i: json.loads(r) for i, r in zip(ids, raw, strict=True) if r}

    def reannounce(self, sid: str, old_msg_id: str) -> None:
        """Hand a session to the next free worker at once (graceful shutdown), unless it
        ended meanwhile."""
        if self.r.exists(session_key(sid)):
            self.announce(sid)
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(self.k.sessions, WORKER_GROUP, old_msg_id)
        pipe.xdel(self.k.sessions, old_msg_id)
        pipe.execute()

    def take_lease(self, sid: str, worker_id: str, ttl_ms: int) -> bool:
        return bool(self.r.set(lease_key(sid), worker_id, nx=True, px=ttl_ms))

    def renew_leases(self, sids: list[str], worker_id: str, ttl_ms: int) -> dict[str, int]:
        """Renew every lease in one round trip; 1 kept, 2 kept and the session's client
        gone (its grace period), 0 lost, -1 session gone."""
        if not sids:
            return {}
        replies = self._evalsha_pipelined(self._renew, [
            ([lease_key(sid), session_key(sid)], [worker_id, ttl_ms]) for sid in sids])
        return {sid: int(_raised(r)) for sid, r in zip(sids, replies, strict=True)}

    def client_gone(self, sid: str) -> bool:
        """The session's keys expire: its client left (the grace period), or it ended."""
        return int(self.r.pttl(session_key(sid))) > 0

    def release_lease(self, sid: str, worker_id: str) -> None:
        self._release(keys=[lease_key(sid)], args=[worker_id])

    def read_audio(self, positions: dict[str, str], count: int, block_ms: int | None):
        """New audio entries of each session after its position: {sid: [(id, pb)]}."""
        if self.cluster:
            return self._read_audio_per_slot(positions, count, block_ms)
        streams: dict[KeyT, StreamIdT] = {audio_key(sid): pos for sid, pos in positions.items()}
        # redis-py types the reply for every protocol and decoding mode; this client's
        # is RESP2 bytes: [(key, [(id, {field: value})])].
        reply: Any = self.r.xread(streams, count=count, block=block_ms)
        out: dict[str, list[tuple[str, bytes]]] = {}
        for key, entries in reply or []:
            sid = sid_from_channel(key.decode())
            out[sid] = [(mid.decode(), fields[b"pb"]) for mid, fields in entries]
        return out

    def _read_audio_per_slot(self, positions: dict[str, str], count: int,
                             block_ms: int | None) -> dict[str, list[tuple[str, bytes]]]:
        """``read_audio`` on a cluster, where one XREAD may not name streams of several
        slots: an XREAD per session, sent in one pipeline (one round trip per node), and
        where nothing came, a pause of up to CLUSTER_POLL_MS instead of a blocking read."""
        pipe = self.r.pipeline(transaction=False)
        sids = list(positions)
        for sid in sids:
            pipe.xread({audio_key(sid): positions[sid]}, count=count)
        out: dict[str, list[tuple[str, bytes]]] = {}
        for sid, reply in zip(sids, pipe.execute(), strict=True):
            for _key, entries in reply or []:
                out[sid] = [(mid.decode(), fields[b"pb"]) for mid, fields in entries]
        if not out and block_ms:
            time.sleep(min(block_ms, CLUSTER_POLL_MS) / 1000)
        return out

    def audio_up_to(self, sid: str, entry_id: str, count: int) -> list[tuple[str, bytes]]:
        """Up to ``count`` audio entries of a session at or before ``entry_id``, newest
        first (a worker's look back before a checkpoint)."""
        reply: Any = self.r.xrevrange(audio_key(sid), entry_id, "-", count=count)
        return [(mid.decode(), fields[b"pb"]) for mid, fields in reply or []]

    def _xrange(self, key: str, start: str,
                count: int | None) -> list[tuple[str, dict[bytes, bytes]]]:
        """XRANGE to the end as this package's clients return it (RESP2, bytes)."""
        reply: Any = self.r.xrange(key, start, "+", count=count)
        return [(mid.decode(), fields) for mid, fields in reply or []]

    def publish_results(self, sid: str, results: Sequence[Published], ttl_s: int,
                        checkpoint: Checkpoint | None = None, done: bool = False) -> bool:
        """Store and publish results, and the checkpoint that follows them; False when the
        session no longer exists."""
        if not results and checkpoint is None and not done:
            return True
        args: list[EncodableT] = [self.stream_maxlen, ttl_s,
                                  checkpoint.to_json() if checkpoint else "", 1 if done else 0]
        args += [messages.to_json(r) for r in results]
        return bool(self._publish(keys=[session_key(sid), text_key(sid), audio_key(sid)],
                                  args=args))

    def heartbeat(self, worker_id: str, capacity: int, ttl_ms: int,
                  load: dict | None = None) -> None:
        """The worker is live for ``ttl_ms`` more, with room for ``capacity`` sessions and
        ``load`` its decode queue now (for GET /load: ``worker_loads``)."""
        self._heartbeat(keys=[self.k.workers, self.k.worker_capacity, self.k.worker_load],
                        args=[worker_id, capacity, ttl_ms, WORKER_FORGET_MS,
                              json.dumps(load, separators=(",", ":")) if load else ""])

    # ---- sweeper ------------------------------------------------------------------------

    def try_lock(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(self.r.set(name, owner, nx=True, px=ttl_ms))

    def announcements(self, after: str = "-", count: int = 500) -> list[Announcement]:
        start = "-" if after == "-" else "(" + after
        return [Announcement(mid, fields.get(b"sid", b"").decode())
                for mid, fields in self._xrange(self.k.sessions, start, count)]

    def last_activity_ms(self, sids: list[str]) -> dict[str, int | None]:
        """Time of each session's newest audio entry, its client's last keepalive or its
        creation, whichever is latest; None if gone."""
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.xrevrange(audio_key(sid), "+", "-", count=1)
            pipe.hmget(session_key(sid), ["created_ms", "alive_ms"])
        replies = pipe.execute()
        out: dict[str, int | None] = {}
        for i, sid in enumerate(sids):
            entries, (created, alive) = replies[2 * i], replies[2 * i + 1]
            times = [int(t) for t in (created, alive) if t is not None]
            if entries:
                times.append(int(entries[0][0].decode().split("-")[0]))
            out[sid] = max(times) if times else None
        return out

    def add_usage(self, day: str, seconds: Mapping[str, float]) -> None:
        """Add audio seconds per client name to ``day``'s usage."""
        key = usage_key(day)
        pipe = self.r.pipeline(transaction=False)
        for name, value in seconds.items():
            pipe.hincrbyfloat(key, name, value)
        pipe.expire(key, USAGE_TTL_S)
        pipe.execute()

    def usage(self, days: list[str]) -> dict[str, dict[str, float]]:
        """day -> client name -> audio seconds, for the days that have any."""
        pipe = self.r.pipeline(transaction=False)
        for day in days:
            pipe.hgetall(usage_key(day))
        out: dict[str, dict[str, float]] = {}
        for day, raw in zip(days, pipe.execute(), strict=True):
            if raw:
                out[day] = {text(k): float(v) for k, v in raw.items()}
        return out

    def save_face(self, face: str, cid: str, state: str, ttl_s: float) -> None:
        """A face's connection state (cosyvoice/store/keys.py, ``face_key``) for ``ttl_s``."""
        self.r.set(face_key(face, cid), state, px=max(1, int(ttl_s * 1000)))

    def load_face(self, face: str, cid: str) -> str | None:
        raw = self.r.get(face_key(face, cid))
        return text(raw) if raw is not None else None

    def touch_session(self, sid: str) -> None:
        """The session's client is there (a keepalive): the sweeper counts it as activity."""
        self._touch(keys=[session_key(sid)], args=[int(time.time() * 1000)])

    def sweep_session(self, sid: str, msg_id: str) -> None:
        """Delete an abandoned session: trim its streams first, then every key."""
        pipe = self.r.pipeline(transaction=False)
        pipe.xtrim(audio_key(sid), maxlen=0)
        pipe.xtrim(text_key(sid), maxlen=0)
        self._delete_keys(pipe, session_keys(sid))
        pipe.xack(self.k.sessions, WORKER_GROUP, msg_id)
        pipe.xdel(self.k.sessions, msg_id)
        self._ended(pipe)
        pipe.execute()

    def remove_worker(self, worker_id: str) -> None:
        """A stopping worker leaves: no longer live, its consumer forgotten once empty."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(self.k.workers, worker_id)
        pipe.hdel(self.k.worker_capacity, worker_id)
        pipe.hdel(self.k.worker_load, worker_id)
        pipe.execute()
        self.forget_consumers([worker_id])

    def dead_consumers(self) -> list[str]:
        """Consumers of the group that are not live workers (killed or stopped ones)."""
        try:
            consumers = self.r.xinfo_consumers(self.k.sessions, WORKER_GROUP)
        except redis.ResponseError:
            return []  # no stream or group yet
        live = {w["id"] for w in self.live_workers()}
        return [c["name"].decode() for c in consumers if c["name"].decode() not in live]

    def forget_consumers(self, names: list[str]) -> int:
        """Delete these consumers from the group, each only if it holds no announcement."""
        return int(self._forget(keys=[self.k.sessions], args=names)) if names else 0

"""The gateway's two links to Redis, one greenlet each per gateway process.

``ChunkWriter`` appends every connection's chunks in arrival order, batched per round
trip; ``ResultRelay`` subscribes to the result channels of this process's sessions and
delivers each result to its session's output (cosyvoice/gateway/outputs.py: the Socket.IO
connection, or another face's) exactly once, replaying what a connection missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import gevent
import gevent.select
import redis
from gevent.event import AsyncResult
from gevent.lock import Semaphore
from gevent.queue import Queue
from redis.client import PubSub

from .. import metrics
from ..store import bus as busmod
from ..store import keys
from ..store.backoff import Backoff
from ..wire import messages
from ..wire.protocol import Chunk
from .outputs import Output

log = logging.getLogger("cosyvoice.gateway")

# Largest batch of chunks written to Redis in one round trip.
WRITE_BATCH = 256
# How long a handler waits for its chunk to be stored before answering `unavailable`.
WRITE_TIMEOUT_S = 10.0
# What an unsubscribe raises on a subscriber connection that broke under it: redis-py's
# errors, and the socket's (EBADF) or its buffer's ("I/O operation on closed file").
BROKEN_SUBSCRIBER = (redis.RedisError, OSError, ValueError)
# How long a subscriber's reader waits for data before it looks again (whether it is still
# subscribed, whether its node is still one it reads).
READ_WAIT_S = 1.0


def _unsubscribe_failed(channel: str, exc: Exception) -> None:
    """Nothing to undo: the route is gone, so whatever still arrives on the channel is
    dropped, and a reconnected subscriber that takes the channel up again costs no more."""
    metrics.REDIS_ERRORS.inc()
    log.warning("could not unsubscribe %s: %s", channel, exc)


class ChunkWriter:
    """Appends chunks to Redis from one greenlet, in arrival order, batched per round trip.

    A connection's events are handled one after another in its reader greenlet
    (``async_handlers=False``), and chunks of all connections meet on this queue, so
    chunks reach Redis in the order they arrived; the append script then checks each
    seq atomically.
    """

    def __init__(self, bus: busmod.Bus):
        self.bus = bus
        self.queue: Queue = Queue()
        self._greenlet = gevent.spawn(self._run)

    def append(self, session: str, chunk: Chunk, pb: bytes):
        done = AsyncResult()
        self.queue.put((session, chunk.seq, pb, chunk.sample_rate, chunk.last, done))
        return done.get(timeout=WRITE_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            # Let the other handlers that are ready now queue their chunks first: one
            # round trip then carries all of them.
            gevent.sleep(0)
            while len(batch) < WRITE_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for item, reply in zip(batch, self._append(batch), strict=True):
                item[5].set(reply)

    def _append(self, batch: list) -> list:
        """The append replies of a batch, one per chunk; a failure is every chunk's reply
        (the writer outlives any batch: were it to die, no chunk would be stored again)."""
        try:
            replies = list(self.bus.append_chunks([item[:5] for item in batch]))
        except redis.RedisError as exc:
            log.warning("redis append failed: %s", exc)
            metrics.REDIS_ERRORS.inc()
            return [exc] * len(batch)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.error("append failed", exc_info=exc)
            return [exc] * len(batch)
        if len(replies) != len(batch):
            error = RuntimeError(f"{len(replies)} append replies for {len(batch)} chunks")
            log.error("%s", error)
            return [error] * len(batch)
        return replies


@dataclass
class Route:
    """Where one session's results go, and which of them the connection already has."""

    output: Output
    last_id: str | None = None
    replaying: bool = True
    held: list = field(default_factory=list)


class ResultRelay:
    """One Redis subscriber per gateway process, routing results to connections.

    Results carry their replay-stream id; a route drops any id it has already passed,
    so replay (after a resume, or after the subscriber lost Redis) and live delivery
    never show a client the same result twice. On a Redis Cluster the results come by
    sharded pub/sub, one reader per node (``ShardedChannels``).
    """

    def __init__(self, client: redis.Redis, bus: busmod.Bus, start: bool = True):
        self.bus = bus
        self.routes: dict[str, Route] = {}  # session id -> route
        self.channels: Channels | ShardedChannels = (
            ShardedChannels(client, self) if bus.cluster else Channels(client, self))
        if start:
            self.channels.start()

    def subscribe(self, session: str, output: Output, after: str | None = None) -> None:
        """Route the session's results to ``output``.

        ``after=None`` means a new session: nothing to replay. Otherwise live results are
        held until ``replay`` has sent those stored after ``after`` ("-": all of them).
        """
        last = None if after in (None, "-") else after
        self.routes[session] = Route(output, last, replaying=after is not None)
        self.channels.add(keys.text_key(session))

    def replay(self, session: str) -> None:
        route = self.routes.get(session)
        if route is not None:
            self._replay(session, route)

    def unsubscribe(self, session: str, output_id: str | None = None) -> None:
        """Stop routing the session's results (while ``output_id``, if given, is still
        its output's: a connection that replaced it keeps its route)."""
        route = self.routes.get(session)
        if route is None or (output_id is not None and route.output.id != output_id):
            return
        del self.routes[session]
        self.channels.remove(keys.text_key(session))

    def missed(self, channels: list[str] | None = None) -> None:
        """Results may have been published while nobody listened on ``channels`` (None:
        all of them): send each of those sessions what its connection lacks."""
        sessions = (list(self.routes) if channels is None
                    else [keys.sid_from_channel(c) for c in channels])
        for session in sessions:
            route = self.routes.get(session)
            if route is not None:
                gevent.spawn(self._replay, session, route)

    def _replay(self, session: str, route: Route) -> None:
        """Send what the route lacks from the session's stored results, then what came
        live meanwhile. A read that fails (a primary failing over, Redis restarting) is
        tried again while the route stands: given up, the results it missed would never
        come, and the next live one would pass over them."""
        route.replaying = True
        backoff = Backoff()
        try:
            while self.routes.get(session) is route:
                try:
                    for result_id, payload in self.bus.results_after(session,
                                                                     route.last_id or "-"):
                        self._send(session, route, result_id, payload)
                    break
                except redis.RedisError as exc:
                    backoff.wait(log, f"cannot replay the results of {session}", exc,
                                 gevent.sleep)
        finally:
            route.replaying = False
            held, route.held = route.held, []
            for result_id, payload in held:
                self._send(session, route, result_id, payload)

    def deliver(self, channel: str, data: str) -> None:
        session = keys.sid_from_channel(channel)
        route = self.routes.get(session)
        if route is None:
            return
        result_id, _, payload = data.partition(" ")
        if route.replaying:
            route.held.append((result_id, payload))
        else:
            self._send(session, route, result_id, payload)

    def _send(self, session: str, route: Route, result_id: str, payload: str) -> None:
        if route.last_id is not None and (messages.result_id_key(result_id)
                                          <= messages.result_id_key(route.last_id)):
            return
        route.last_id = result_id
        route.output.send(session, result_id, messages.from_json(payload))


class Subscriber:
    """One subscriber connection (a redis-py ``PubSub``) that greenlets share: its reader,
    and the connections' handlers that (un)subscribe.

    Every use of the socket takes ``lock``: a read, a (un)subscribe, and the reconnect
    redis-py does inside either when the connection broke (it connects again and
    subscribes every channel again, then our connect callback replays what was missed).
    Two greenlets that both reconnected it read each other's handshake: gevent's
    ``ConcurrentObjectUseError``, or a closed buffer's ``ValueError``, which killed the
    reading greenlet, and every session on that connection got no result again. The
    reader waits for data without the lock (on its own watcher of the socket), then reads
    what came under it, so an (un)subscribe waits for no read.
    """

    def __init__(self, pubsub: PubSub):
        self.pubsub = pubsub
        self.lock = Semaphore()

    def read(self, timeout: float = READ_WAIT_S) -> list[dict]:
        """The messages that came within ``timeout`` (none where nothing is subscribed
        yet); raises what a broken connection that could not be made again raises."""
        if not self.pubsub.subscribed:
            gevent.sleep(0.05)
            return []
        _wait_readable(self.pubsub.connection, timeout)
        with self.lock:
            messages: list[dict] = []
            # get_message's two steps: its None is also a message read and dropped (a
            # subscribe's confirmation), and others may be buffered behind that one. The
            # read's None is also the answer to redis-py's health check, dropped: only a
            # second None in a row says nothing more has come.
            nothing = 0
            while nothing < 2:
                response = self.pubsub.parse_response(block=False, timeout=0)
                if response is None:
                    nothing += 1
                    continue
                nothing = 0
                msg = self.pubsub.handle_message(response)
                if msg is not None:
                    messages.append(msg)
            return messages

    def close(self) -> None:
        with self.lock:
            try:
                self.pubsub.close()
            except BROKEN_SUBSCRIBER:
                pass


def _wait_readable(conn: Any, timeout: float) -> None:
    """Wait until the connection's socket has data, at most ``timeout``. A socket closed
    meanwhile (the connection was made again under the lock) ends the wait: the read
    under the lock follows."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        gevent.sleep(0.05)
        return
    if getattr(sock, "pending", lambda: 0)():  # TLS: decrypted bytes already waiting
        return
    try:
        gevent.select.select([sock], [], [], timeout)
    except Exception:  # noqa: BLE001 - closed under us (EBADF, fileno -1): read now
        gevent.sleep(0.05)


class Channels:
    """The result channels of one gateway process on one Redis: one connection
    subscribed to them all, read by one greenlet."""

    def __init__(self, client: redis.Redis, relay: ResultRelay):
        self.relay = relay
        self.subscriber = Subscriber(client.pubsub(ignore_subscribe_messages=True))
        self._watched: object = None

    def start(self) -> None:
        gevent.spawn(self._run)

    def add(self, channel: str) -> None:
        with self.subscriber.lock:
            self.subscriber.pubsub.subscribe(channel)
            self._watched = on_reconnect(self.subscriber.pubsub, self._watched,
                                         self._reconnected)

    def _reconnected(self, _connection) -> None:
        """redis-py connected the subscriber again and subscribed it to every channel:
        results published meanwhile reached nobody."""
        log.info("result subscriber reconnected; replaying missed results")
        self.relay.missed()

    def remove(self, channel: str) -> None:
        with self.subscriber.lock:
            try:
                self.subscriber.pubsub.unsubscribe(channel)
            except BROKEN_SUBSCRIBER as exc:
                _unsubscribe_failed(channel, exc)

    def _run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                messages = self.subscriber.read()
                backoff.succeeded()
            except Exception as exc:  # noqa: BLE001 - the reader must outlive any error
                if not isinstance(exc, redis.RedisError):
                    log.exception("result subscriber failed")
                metrics.REDIS_ERRORS.inc()
                # The read that connects it again replays, through _reconnected.
                backoff.wait(log, "result subscriber lost redis", exc, gevent.sleep)
                continue
            for msg in messages:
                if msg["type"] == "message":
                    _deliver(self.relay, msg)


class ShardedChannels:
    """The result channels of one gateway process on a Redis Cluster, by sharded pub/sub:
    each channel is subscribed (SSUBSCRIBE) on the primary that owns its slot, one
    connection and one reading greenlet per primary.

    Sharded pub/sub is lost when a node fails over or a slot moves (the server then
    ends the channel's subscription): the channel is subscribed again on its owner as the
    cluster now says it is, and its session's results are replayed from ``text:{SID}``.
    """

    def __init__(self, client: redis.Redis, relay: ResultRelay):
        self.cluster: Any = client  # a RedisCluster (connect(cluster=True))
        self.relay = relay
        self.readers: dict[str, Subscriber] = {}  # node name -> its subscriber
        self.owner: dict[str, str] = {}  # channel -> the node it is subscribed on
        self._watchers: dict[str, _NodeWatch] = {}
        self._lock = Semaphore()
        self._started = False

    def start(self) -> None:
        self._started = True
        for name in list(self.readers):
            gevent.spawn(self._run, name)

    def add(self, channel: str) -> None:
        with self._lock:
            self._subscribe(channel)

    def remove(self, channel: str) -> None:
        with self._lock:
            name = self.owner.pop(channel, None)
            reader = self.readers.get(name) if name else None
            if reader is not None:
                with reader.lock:
                    try:
                        reader.pubsub.sunsubscribe(channel)
                    except BROKEN_SUBSCRIBER as exc:
                        _unsubscribe_failed(channel, exc)

    def _subscribe(self, channel: str) -> None:
        node = self.cluster.get_node_from_key(channel)
        reader = self.readers.get(node.name)
        if reader is None:
            conn = redis.Redis(host=node.host, port=node.port, health_check_interval=30,
                               **self._credentials())
            reader = self.readers[node.name] = Subscriber(conn.pubsub())
            self._watchers[node.name] = _NodeWatch(self, node.name)
            if self._started:
                gevent.spawn(self._run, node.name)
        with reader.lock:
            reader.pubsub.ssubscribe(channel)
            self.owner[channel] = node.name
            watch = self._watchers[node.name]
            watch.connection = on_reconnect(reader.pubsub, watch.connection,
                                            watch.reconnected)

    def _credentials(self) -> dict:
        """The cluster client's user, password and TLS, for a node's own subscriber."""
        kwargs = self.cluster.nodes_manager.connection_kwargs
        return {k: v for k, v in kwargs.items()
                if k in ("username", "password", "credential_provider") or k.startswith("ssl")}

    def reconnected(self, name: str) -> None:
        """redis-py connected a node's subscriber again and subscribed it to its
        channels: results published on them meanwhile reached nobody."""
        log.info("result subscriber of %s reconnected; replaying missed results", name)
        self.relay.missed([c for c, n in self.owner.items() if n == name])

    def _run(self, name: str) -> None:
        while True:
            reader = self.readers.get(name)
            if reader is None:
                return
            try:
                messages = reader.read()
            except Exception as exc:  # noqa: BLE001 - the node's reader must outlive any error
                if not isinstance(exc, redis.RedisError):
                    log.exception("result subscriber of %s failed", name)
                log.warning("result subscriber of %s lost it: %s", name, exc)
                metrics.REDIS_ERRORS.inc()
                self._lost(name)
                return
            for msg in messages:
                if msg["type"] == "smessage":
                    _deliver(self.relay, msg)
                elif msg["type"] == "sunsubscribe":
                    self._moved(name, msg["channel"].decode())

    def _lost(self, name: str) -> None:
        """A node's subscriber failed (the node died, or failed over): find each of its
        channels' owner anew, subscribe there, replay what may have been missed."""
        with self._lock:
            reader = self.readers.pop(name, None)
            self._watchers.pop(name, None)
            channels = [c for c, n in self.owner.items() if n == name]
            for channel in channels:
                del self.owner[channel]
        if reader is not None:
            reader.close()
        self._resubscribe(channels)

    def _moved(self, name: str, channel: str) -> None:
        """The server ended a subscription: its slot moved (or we asked, and the channel
        is no longer ours)."""
        if self.owner.get(channel) != name:
            return
        log.info("%s: subscription ended by %s (its slot moved); subscribing again",
                 channel, name)
        with self._lock:
            del self.owner[channel]
        self._resubscribe([channel])

    def _resubscribe(self, channels: list[str]) -> None:
        backoff = Backoff()
        while channels:
            try:
                self.cluster.nodes_manager.initialize()
                with self._lock:
                    for channel in channels:
                        if keys.sid_from_channel(channel) in self.relay.routes:
                            self._subscribe(channel)
                            log.info("%s: subscribed on %s", channel, self.owner[channel])
                break
            except redis.RedisError as exc:
                backoff.wait(log, "cannot subscribe again", exc, gevent.sleep)
        self.relay.missed(channels)


class _NodeWatch:
    """Tells ``ShardedChannels`` that one node's subscriber connected again (redis-py
    keeps its connect callbacks as weak references: this object holds the method)."""

    def __init__(self, channels: ShardedChannels, name: str):
        self.channels = channels
        self.name = name
        self.connection: object = None

    def reconnected(self, _connection) -> None:
        self.channels.reconnected(self.name)


def on_reconnect(pubsub: PubSub, watched: object, callback) -> object:
    """Have ``callback`` called each time redis-py connects ``pubsub`` again, which it
    does by itself inside a read after the connection failed, subscribing it again to
    every channel first (its own callback, registered before ours). Returns the
    connection now watched; ``watched`` is the one watched before (the connection exists
    from the first subscription on, so the first connect is never reported)."""
    connection = pubsub.connection
    if connection is not None and connection is not watched:
        connection.register_connect_callback(callback)
        return connection
    return watched


def _deliver(relay: ResultRelay, msg: dict) -> None:
    try:
        relay.deliver(msg["channel"].decode(), msg["data"].decode())
    except Exception:  # noqa: BLE001 - one bad message must not stop delivery
        log.exception("could not deliver a result")

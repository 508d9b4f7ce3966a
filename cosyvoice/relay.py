"""The gateway's two links to Redis, one greenlet each per gateway process.

``ChunkWriter`` appends every connection's chunks in arrival order, batched per round
trip; ``ResultRelay`` subscribes to the result channels of this process's sessions and
emits each result to its socket exactly once, replaying what a connection missed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import gevent
import redis
from flask_socketio import SocketIO
from gevent.event import AsyncResult
from gevent.lock import Semaphore
from gevent.queue import Queue

from . import bus as busmod
from . import keys, messages, metrics
from .backoff import Backoff
from .protocol import NAMESPACE, Chunk

log = logging.getLogger("cosyvoice.gateway")

# Largest batch of chunks written to Redis in one round trip.
WRITE_BATCH = 256
# How long a handler waits for its chunk to be stored before answering `unavailable`.
WRITE_TIMEOUT_S = 10.0


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

    socket_id: str
    last_id: str | None = None
    replaying: bool = True
    held: list = field(default_factory=list)


class ResultRelay:
    """One Redis subscriber per gateway process, routing results to connections.

    Results carry their replay-stream id; a route drops any id it has already passed,
    so replay (after a resume, or after the subscriber lost Redis) and live delivery
    never show a client the same result twice.
    """

    def __init__(self, client: redis.Redis, bus: busmod.Bus, socketio: SocketIO,
                 start: bool = True):
        self.socketio = socketio
        self.bus = bus
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)
        self.routes: dict[str, Route] = {}  # session id -> route
        self._lock = Semaphore()
        self._greenlet = gevent.spawn(self._run) if start else None

    def subscribe(self, session: str, socket_id: str, after: str | None = None) -> None:
        """Route the session's results to ``socket_id``.

        ``after=None`` means a new session: nothing to replay. Otherwise live results are
        held until ``replay`` has sent those stored after ``after`` ("-": all of them).
        """
        last = None if after in (None, "-") else after
        self.routes[session] = Route(socket_id, last, replaying=after is not None)
        with self._lock:
            self.pubsub.subscribe(keys.text_key(session))

    def replay(self, session: str) -> None:
        route = self.routes.get(session)
        if route is not None:
            self._replay(session, route)

    def unsubscribe(self, session: str, socket_id: str | None = None) -> None:
        route = self.routes.get(session)
        if route is None or (socket_id is not None and route.socket_id != socket_id):
            return
        del self.routes[session]
        with self._lock:
            self.pubsub.unsubscribe(keys.text_key(session))

    def _replay(self, session: str, route: Route) -> None:
        route.replaying = True
        try:
            for result_id, payload in self.bus.results_after(session, route.last_id or "-"):
                self._send(session, route, result_id, payload)
        finally:
            route.replaying = False
            held, route.held = route.held, []
            for result_id, payload in held:
                self._send(session, route, result_id, payload)

    def _run(self) -> None:
        backoff = Backoff()
        lost = False
        while True:
            try:
                if not self.pubsub.subscribed:
                    gevent.sleep(0.05)
                    continue
                msg = self.pubsub.get_message(timeout=1.0)
                if lost:
                    # The connection came back and redis-py re-subscribed: fetch what
                    # was published while we were not listening.
                    lost = False
                    log.info("result subscriber reconnected; replaying missed results")
                    for session, route in list(self.routes.items()):
                        gevent.spawn(self._replay, session, route)
                backoff.succeeded()
            except redis.RedisError as exc:
                lost = True
                pause = backoff.failed()
                log.warning("result subscriber lost redis, retrying in %.1fs: %s", pause, exc)
                metrics.REDIS_ERRORS.inc()
                gevent.sleep(pause)
                continue
            if msg and msg["type"] == "message":
                try:
                    self._deliver(msg["channel"].decode(), msg["data"].decode())
                except Exception:  # noqa: BLE001 - one bad message must not stop delivery
                    log.exception("could not deliver a result")

    def _deliver(self, channel: str, data: str) -> None:
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
        event, data = messages.to_event(session, result_id, messages.from_json(payload))
        self.socketio.emit(event, data, to=route.socket_id, namespace=NAMESPACE)

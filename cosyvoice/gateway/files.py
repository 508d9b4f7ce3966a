"""A whole audio file transcribed through a live session, for the gateway's HTTP faces
(OpenAI's ``/v1/audio/transcriptions``: cosyvoice/faces/openai/transcriptions.py).

The gateway never decodes speech: a ``FileSession`` opens a session as a Socket.IO client's
connect would (the same client-slot limit, admission and session options), appends the
file's PCM as 200 ms chunks to the session's stream, and reads the session's results
through the relay into a ``QueueOutput`` until its ``end``. A worker decodes it like any
other session: a worker that dies under it is replaced by one that takes the session over
from its checkpoint, and the results it had published are not repeated.

Pacing: the chunks go in as fast as the session's rate limit allows (``rate_limit_factor``
times real time once its ``rate_limit_burst_s`` is spent, as for any client), and never
more than half the audio stream's length (``stream_maxlen``) ahead of the chunk the
session's worker has checkpointed, so a slow worker never has unread audio trimmed.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gevent
import redis

from .. import metrics
from ..wire.codecs import CHUNK_MS, split_chunks
from ..wire.errors import CosyvoiceError, Internal, Unavailable
from ..wire.messages import Checkpoint, Result
from .apikeys import ANONYMOUS
from .limits import ConnectRequest
from .outputs import QueueOutput

if TYPE_CHECKING:
    from .core import Connection, Gateway

log = logging.getLogger(__name__)

# How often the feeder reads the worker's checkpoint while it is ahead of it (chunks).
CHECK_EVERY = 25
# How long a file's session may go without a result before the request fails: longer
# than a worker's take-over of a dead predecessor's sessions.
IDLE_S = 120.0


class ResultError(CosyvoiceError):
    """The session ended with an error result (its code is the worker's)."""

    def __init__(self, code: str, msg: str):
        super().__init__(msg)
        self.code = code


class FileSession:
    """One file's PCM (``rate`` Hz, 16-bit mono) through a session opened for ``req``."""

    def __init__(self, gateway: Gateway, pcm: bytes, rate: int, req: ConnectRequest,
                 label: str = "file", subject: str = ANONYMOUS):
        self.gateway = gateway
        self.chunks = split_chunks(pcm, rate)
        self.rate = rate
        self.req = req
        self.output = QueueOutput(f"{label}-{secrets.token_hex(6)}")
        self.conn: Connection | None = None
        self._feeder: gevent.Greenlet | None = None
        self.duration_s = len(pcm) / 2 / rate
        self.subject = subject  # who the audio counts to (cosyvoice/gateway/apikeys.py)

    def open(self) -> None:
        """Open and admit the session; raises the connect's ``CosyvoiceError``
        (``overloaded``, ``rate_limited``, ``unavailable``...)."""
        try:
            self.conn = self.gateway.open_session(self.req, self.output.id, self.output,
                                                  self.subject)
        except redis.RedisError as exc:
            metrics.REDIS_ERRORS.inc()
            raise Unavailable("the session store is unreachable") from exc

    def finals(self, idle_s: float = IDLE_S) -> Iterator[Result]:
        """The session's finals in order (the chunks go in meanwhile), until its ``end``;
        raises a ``CosyvoiceError`` for an error result, a chunk refused, or no result
        for ``idle_s``."""
        assert self.conn is not None, "open() first"
        if not self.chunks:
            return
        self._feeder = gevent.spawn(self._feed, self.conn)
        while True:
            item = self.output.get(idle_s)
            if item is None:
                raise Unavailable(f"no result for {idle_s:.0f} s: no worker is decoding it")
            message = item[1]
            if message["type"] == "final":
                yield message
            elif message["type"] == "end":
                return
            elif message["type"] == "error":
                raise ResultError(message["code"], message["msg"])

    def close(self) -> None:
        """End the session (done, failed or abandoned): its keys and client slot go."""
        if self._feeder is not None:
            self._feeder.kill(block=False)
        if self.conn is not None:
            conn, self.conn = self.conn, None
            try:
                self.gateway.close_session(conn, self.output.id)
            except redis.RedisError as exc:
                metrics.REDIS_ERRORS.inc()
                log.warning("could not delete file session %s: %s", conn.session, exc)

    # ---- the feeder greenlet ----------------------------------------------------------

    def _feed(self, conn: Connection) -> None:
        try:
            last = len(self.chunks) - 1
            settings = self.gateway.settings
            ahead = max(1, settings.stream_maxlen // 2)
            done = -1  # the last chunk the worker has checkpointed, as last read
            for seq, pcm in enumerate(self.chunks):
                while seq - done > ahead:
                    done = self._checkpointed(conn)
                    if seq - done > ahead:
                        gevent.sleep(CHUNK_MS / 1000)
                self.gateway.store_pcm(conn, pcm, seq, self.rate, last=seq == last)
                if seq % CHECK_EVERY == 0 and seq - done > ahead // 2:
                    done = self._checkpointed(conn)
        except CosyvoiceError as err:
            self.output.send(conn.session, "", {"type": "error", "code": err.code,
                                                "msg": err.msg})
        except Exception as exc:  # noqa: BLE001 - the request fails, not the gateway
            log.error("feeding a file session failed", exc_info=exc)
            self.output.send(conn.session, "", {"type": "error", "code": Internal.code,
                                                "msg": "internal error"})

    def _checkpointed(self, conn: Connection) -> int:
        raw = self.gateway.bus.session_info(conn.session).get("checkpoint")
        return Checkpoint.from_json(raw).seq if raw else -1

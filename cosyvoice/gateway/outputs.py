"""Outputs: where the gateway delivers a session's results.

The gateway's relay (cosyvoice/gateway/relay.py) reads every result a worker publishes, drops what
a connection already has, replays what it missed, and hands each result, once and in
order, to the session's ``Output``. An output only translates: it never decodes audio,
never holds results of its own beyond what its reader has not taken yet, and leaves
admission, tokens, limits, resume and metrics to the session below it. Two outputs:

- ``SocketIOOutput``: the Socket.IO face (``/ws``), one ``emit`` per result to the
  connection (cosyvoice/gateway/core.py);
- ``QueueOutput``: a queue the request's own greenlet reads, for faces that answer from
  a handler of their own (an HTTP response streamed as it is decoded, a raw WebSocket).

A new face brings its output (one class here or in its own module) and registers its
routes in ``cosyvoice/webui.py``'s ``FACES`` (one line); docs/architecture.md has an
example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

from gevent.queue import Empty, Queue

from ..wire import messages
from ..wire.messages import Published
from ..wire.protocol import NAMESPACE


class Output(Protocol):
    """One session's results, delivered. ``id`` names the connection it belongs to: a
    disconnect removes the session's output only while it is still that connection's."""
    id: str

    def send(self, session: str, result_id: str, message: Published) -> None:
        """Deliver one result (``result_id``: its id in the replay stream)."""
        ...


class SocketIOOutput:
    """The Socket.IO face: each result as the event ``messages.to_event`` names; with
    ``partials`` False (``auth.interim: false``), finals only."""

    def __init__(self, socketio, socket_id: str, partials: bool = True,
                 on_final: Callable[[str, Any], None] | None = None):
        self.socketio = socketio
        self.id = socket_id
        self.partials = partials
        self.on_final = on_final  # told of each final sent (its session, the final)

    def send(self, session: str, result_id: str, message: Published) -> None:
        if not self.partials and message["type"] == "partial":
            return
        if message["type"] == "final" and self.on_final is not None:
            self.on_final(session, message)
        event, data = messages.to_event(session, result_id, message)
        self.socketio.emit(event, data, to=self.id, namespace=NAMESPACE)


class QueueOutput:
    """Results into a queue, read by the handler that serves them (``get``)."""

    def __init__(self, output_id: str):
        self.id = output_id
        self._queue: Queue = Queue()

    def send(self, session: str, result_id: str, message: Published) -> None:
        self._queue.put((result_id, message))

    def get(self, timeout_s: float) -> tuple[str, Published] | None:
        """The next result and its id, or None when none came within ``timeout_s``."""
        try:
            return self._queue.get(timeout=timeout_s)
        except Empty:
            return None


class SessionsOutput(QueueOutput):
    """The results of a connection's several sessions (a raw-WebSocket face's: a
    Realtime connection's, a Deepgram stream's channels), each with its session."""

    def send(self, session: str, result_id: str, message: Published) -> None:
        self._queue.put((session, result_id, message))

    def each(self, running: Callable[[], bool]) -> Iterator[tuple[str, str, Any]]:
        """(session, result id, message) as they come, while ``running()``."""
        while running():
            got = self.get(1.0)
            if got is not None:
                yield cast(Any, got)


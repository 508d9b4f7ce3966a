"""Flask-SocketIO's test client, connected the way a real client is."""

from __future__ import annotations

import time

import gevent
from socketio import packet

from cosyvoice.wire.protocol import NAMESPACE

from .launcher import scaled


def open_test_client(app, auth=None, until_session: bool = False):
    """Connect to ``/ws``; ``client.refusal`` is the wire error of a refused connection
    (the ``data`` of the Socket.IO connect error).

    The test client does not keep the data of a refusal (a CONNECT_ERROR packet), so it
    is captured on its way out. Flask's test client gives the connection an address.
    The events after connect come from a greenlet: the client waits 10 ms for them, or
    with ``until_session`` until the ``session`` event (notices come before it) has come.
    """
    socketio = app.extensions["socketio"]
    client = socketio.test_client(app, namespace="/", flask_test_client=app.test_client())
    inner = socketio.server._send_packet
    refusals = []

    def capture(eio_sid, pkt):
        if pkt.packet_type == packet.CONNECT_ERROR and eio_sid == client.eio_sid:
            refusals.append(pkt.data["data"])
        return inner(eio_sid, pkt)

    socketio.server._send_packet = capture
    try:
        client.connect(NAMESPACE, auth=auth)
    finally:
        socketio.server._send_packet = inner
    client.refusal = refusals[0] if refusals else None
    if not until_session:
        gevent.sleep(0.01)
    elif client.refusal is None:
        deadline = time.monotonic() + scaled(5)
        while time.monotonic() < deadline and not any(
                p["name"] == "session" and p["namespace"] == NAMESPACE for p in client.queue):
            gevent.sleep(0.001)
    return client

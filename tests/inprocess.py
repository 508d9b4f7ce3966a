"""Flask-SocketIO's test client, connected the way a real client is."""

from __future__ import annotations

import gevent
from socketio import packet

from cosyvoice.protocol import NAMESPACE


def open_test_client(app, auth=None):
    """Connect to ``/ws``; ``client.refusal`` is the wire error of a refused connection
    (the ``data`` of the Socket.IO connect error).

    The test client does not keep the data of a refusal (a CONNECT_ERROR packet), so it
    is captured on its way out. Flask's test client gives the connection an address.
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
    gevent.sleep(0.01)  # the events after connect come from a greenlet
    client.refusal = refusals[0] if refusals else None
    return client

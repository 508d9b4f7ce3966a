"""The framework's floor: a bare Flask-SocketIO app that acks every audio chunk.

Same server stack as the gateway (gevent, gevent-websocket's handler under gevent's
WSGI server, Flask-SocketIO in gevent mode, WebSocket transport only, namespace
``/ws``), but the handler does nothing beyond answering the ack: no validation, no
Redis, no results. The transport benchmark runs it next to the gateway to express the
gateway's CPU per chunk as a multiple of this floor.

    python benchmarks/echo_server.py --port 5001 [--stock-unmask]
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def create_echo_app(fast_unmask: bool = True):
    from flask import Flask, jsonify
    from flask_socketio import SocketIO

    from cosyvoice.wire.protocol import max_payload_bytes

    if fast_unmask:
        from cosyvoice.gateway import fastws
        fastws.install()
    app = Flask(__name__)
    socketio = SocketIO(app, async_mode="gevent", transports=["websocket"],
                        max_http_buffer_size=max_payload_bytes(1000) + 1024)

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @socketio.on("connect", namespace="/ws")
    def on_connect(auth=None):
        return True

    @socketio.on("audio_chunk", namespace="/ws")
    def on_audio_chunk(data=None):
        return {"bytes": len(data or b"")}

    @socketio.on("stop", namespace="/ws")
    def on_stop(data=None):
        return {"stopped": True}

    return app


def main() -> None:
    from gevent import pywsgi
    from geventwebsocket.handler import WebSocketHandler

    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--stock-unmask", action="store_true",
                    help="keep gevent-websocket's per-byte unmasking loop")
    args = ap.parse_args()
    app = create_echo_app(fast_unmask=not args.stock_unmask)
    server = pywsgi.WSGIServer((args.host, args.port), app, handler_class=WebSocketHandler,
                               log=None)
    print(f"echo listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

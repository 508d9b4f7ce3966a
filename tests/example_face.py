"""The example face of docs/architecture.md, "Adding a face": an HTTP route that answers
with a session's results so far, read through the gateway's relay into a ``QueueOutput``.
Installed by tests/inprocess/test_outputs.py the way ``cosyvoice.webui.FACES`` installs a face."""

from __future__ import annotations

import secrets

from flask import Flask, jsonify

from cosyvoice.gateway.core import Gateway
from cosyvoice.gateway.outputs import QueueOutput

# How long the route waits for the next result before it answers with what it has.
WAIT_S = 0.5


def install(app: Flask, gateway: Gateway) -> None:
    @app.get("/example/sessions/<session>/results")
    def session_results(session: str):
        output = QueueOutput(f"example-{secrets.token_hex(4)}")
        gateway.relay.subscribe(session, output, after="-")  # "-": from the first result
        try:
            gateway.relay.replay(session)
            out = []
            while (item := output.get(WAIT_S)) is not None:
                out.append(item[1])
                if item[1]["type"] in ("end", "error"):
                    break
            return jsonify(out)
        finally:
            gateway.relay.unsubscribe(session, output.id)

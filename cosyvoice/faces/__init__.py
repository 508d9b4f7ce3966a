"""The faces: the APIs clients speak, each over the gateway.

``socketio`` (namespace ``/ws``: the page's and the CLI's own protocol), ``openai``
(``transcriptions``: ``POST /v1/audio/transcriptions`` and the models routes;
``realtime``: ``/v1/realtime``) and ``deepgram`` (``listen`` and ``results``: the live
``/v1/listen``; ``prerecorded``: its ``POST``). The app installs
each (``cosyvoice.webui``: Socket.IO always, the rest as ``FACES`` lists).

Imports: the gateway, the text stages, the wire, settings and metrics. No face imports
another, nor the store, the worker or the engines: a face opens, feeds and reads sessions
through the gateway.
"""

"""The faces beside Socket.IO: the APIs clients already speak, each over the gateway.

``openai`` (``transcriptions``: ``POST /v1/audio/transcriptions`` and the models routes;
``realtime``: ``/v1/realtime``) and ``deepgram`` (``listen`` and ``results``: the live
``/v1/listen``; ``prerecorded``: its ``POST``). The app installs each
(``cosyvoice.webui.FACES``).

Imports: the gateway, the text stages, the wire, settings and metrics. No face imports
another, nor the store, the worker or the engines: a face opens, feeds and reads sessions
through the gateway.
"""

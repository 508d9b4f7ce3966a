"""The gateway: connections, sessions and their results, for every face.

``core`` (the ``Gateway``: Socket.IO's handlers and each connection's state; opening,
admitting, feeding and closing a session for any face), ``relay`` (the chunk writer and
the result relay), ``outputs`` (where a session's results go), ``limits`` (the ``auth``
rules and the token bucket), ``apikeys`` and ``tokens`` (who a client is), ``load`` and
``probes`` (``/load``, ``/readyz``, ``/metrics``), ``files`` (a whole file through a
session), and the WebSocket plumbing every face shares: ``wshandler`` (the checks before
an upgrade), ``wsframes`` (bounded messages), ``fastws`` (fast unmasking).

Imports: the store, the text stages, the wire, settings and metrics; never the worker,
the engines' code or a face.
"""

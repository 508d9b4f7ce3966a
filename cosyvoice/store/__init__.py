"""The store: the Redis layer, the only place that speaks to Redis.

``bus`` (every command cosyvoice sends, the ``Bus``), ``connection`` (clients of one Redis
or a cluster), ``replies`` (the shapes of the bus's answers), ``keys`` (every key name),
``scripts`` and ``lua/`` (the Lua scripts and the pure rules they call), ``backoff`` (the
pause before trying Redis again), ``embedded_redis`` (the redis-server of ``cosyvoice
serve``).

Imports: the wire, settings and metrics; nothing of the gateway, the worker, the faces.
"""

"""The worker: owns sessions by lease and decodes their audio.

``loop`` (the ``Worker``: leases, placement, the decode loop), ``pool`` (the pre-fork pool
of worker processes), ``outbox`` (a session's results in order, pure), ``sweeper``
(sessions nobody will end), ``hostload`` (the cores other work keeps busy).

Imports: the engines (``cosyvoice.asr``), the text stages, the store, the wire, settings
and metrics; never the gateway or a face.
"""

"""The wire: what crosses a hop, and nothing that does I/O.

The chunk format and its validation (``protocol``, the generated ``chunk_pb``), every
message and result as it is stored and emitted (``messages``), the codecs and a session's
audio (``codecs``, ``audio``, ``live_audio``, ``resample``), adaptive bitrate (``abr``),
the error codes (``errors``), the languages and the engines' registry a client may name
(``languages``, ``registry``).

Imports: nothing of cosyvoice above it (the lowest layer with logs, ``metrics_dir`` and
``debug_mem``; pyproject.toml ``[tool.importlinter]``).
"""

"""What happens to a final's text: the stages between an engine and the client.

The 2-pass engine's finals process (``finals``), the session's text stages and the
engine's deferred stage (``stages``), Chinese script (``script``), smart formatting
(``formatting``), speaker labels (``speakers``), and finals as text, JSON, SRT and WebVTT
(``subtitles``).

Imports: the wire, settings and metrics; nothing of the store, the engines above it, the
gateway, the worker or the faces.
"""

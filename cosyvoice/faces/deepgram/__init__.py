"""Deepgram's face, ``/v1/listen``: live (``listen``, a raw WebSocket, and ``results``,
what it sends back) and pre-recorded (``prerecorded``, ``POST``), sharing the query, the
errors and the shapes of a response (``params``)."""

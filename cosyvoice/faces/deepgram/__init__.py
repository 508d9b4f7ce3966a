"""Deepgram's face: ``/v1/listen``, live (a raw WebSocket) and pre-recorded (``POST``)."""

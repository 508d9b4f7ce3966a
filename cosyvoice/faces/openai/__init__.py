"""OpenAI's faces: the transcription REST API (``transcriptions``) and the Realtime
transcription WebSocket (``realtime``; its handshake and session configuration in
``realtime_setup``), which share OpenAI's error shape."""

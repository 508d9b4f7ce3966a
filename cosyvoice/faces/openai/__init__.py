"""OpenAI's faces: the transcription REST API (``transcriptions``) and the Realtime
transcription WebSocket (``realtime``), which share OpenAI's error shape."""

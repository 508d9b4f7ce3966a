"""The wire codec: the AudioChunkProto message and the rules every chunk must pass.

Pure functions, no I/O: the gateway validates with ``decode_chunk`` before anything
reaches Redis, and the worker decodes the stored bytes with ``parse_stored``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chunk_pb import AudioChunkProto
from .errors import BadChunk, TooLarge, UnsupportedRate

# The Socket.IO namespace of the streaming protocol.
NAMESPACE = "/ws"
CHUNK_MS = 200
SAMPLE_WIDTH = 2
# Sample rates a session may stream at: every engine's front end resamples them exactly.
SUPPORTED_RATES = (8000, 16000, 48000)
# Field tags and varint lengths around the PCM: a generous bound for the envelope.
_ENVELOPE_BYTES = 64
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Chunk:
    """A validated audio chunk. ``sample_rate`` is resolved (never 0)."""

    pcm: bytes
    seq: int
    last: bool
    sample_rate: int
    sent_ms: int

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / (SAMPLE_WIDTH * self.sample_rate)


def chunk_bytes(sample_rate: int, ms: int = CHUNK_MS) -> int:
    """Bytes of PCM in ``ms`` milliseconds of 16-bit mono audio at ``sample_rate``."""
    return sample_rate * ms // 1000 * SAMPLE_WIDTH


def max_payload_bytes(max_chunk_ms: int) -> int:
    """Largest ``audio_chunk`` payload accepted at any supported rate."""
    return chunk_bytes(max(SUPPORTED_RATES), max_chunk_ms) + _ENVELOPE_BYTES


def encode_chunk(pcm: bytes, seq: int, *, last: bool = False, sample_rate: int = 0,
                 sent_ms: int = 0) -> bytes:
    """Serialise one chunk as the client sends it."""
    return bytes(AudioChunkProto(pcm=pcm, seq=seq, last=last, sample_rate=sample_rate,
                                 sent_ms=sent_ms))


def _parse(data: bytes) -> AudioChunkProto:
    try:
        msg = AudioChunkProto().parse(data)
    except Exception as exc:  # betterproto raises assorted errors on junk
        raise BadChunk(f"not an AudioChunkProto message ({type(exc).__name__})") from exc
    # betterproto accepts wrong wire types and hands back ints for bytes, lists for
    # ints: check every field's type, not just that parsing returned.
    if not isinstance(msg.pcm, bytes):
        raise BadChunk("field pcm must be bytes")
    for name, limit in (("seq", _UINT32_MAX), ("sample_rate", _UINT32_MAX),
                        ("sent_ms", _UINT64_MAX)):
        value = getattr(msg, name)
        if type(value) is not int or not 0 <= value <= limit:
            raise BadChunk(f"field {name} must be an unsigned integer")
    if type(msg.last) is not bool:
        raise BadChunk("field last must be a bool")
    return msg


def decode_chunk(data, current_rate: int, max_chunk_ms: int) -> Chunk:
    """Validate one ``audio_chunk`` payload against the session's current rate.

    Raises ``BadChunk``, ``TooLarge`` or ``UnsupportedRate``; sequence rules are the
    gateway's (they need the session's state in Redis).
    """
    if isinstance(data, bytearray):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise BadChunk("audio_chunk payload must be binary protobuf bytes")
    if len(data) > max_payload_bytes(max_chunk_ms):
        raise TooLarge(f"payload of {len(data)} bytes exceeds the limit")
    msg = _parse(data)
    rate = msg.sample_rate or current_rate
    if rate not in SUPPORTED_RATES:
        raise UnsupportedRate(f"sample rate {rate} not in {SUPPORTED_RATES}", seq=msg.seq)
    if len(msg.pcm) % SAMPLE_WIDTH:
        raise BadChunk(f"pcm length {len(msg.pcm)} is odd; 16-bit samples expected",
                       seq=msg.seq)
    if len(msg.pcm) > chunk_bytes(rate, max_chunk_ms):
        raise TooLarge(f"chunk holds more than {max_chunk_ms} ms of audio", seq=msg.seq)
    if not msg.pcm and not msg.last:
        raise BadChunk("empty chunk: pcm may be empty only with last=true", seq=msg.seq)
    return Chunk(pcm=msg.pcm, seq=msg.seq, last=msg.last, sample_rate=rate,
                 sent_ms=msg.sent_ms)


def parse_stored(data: bytes) -> AudioChunkProto:
    """Parse a chunk the gateway already validated and stored."""
    return AudioChunkProto().parse(data)

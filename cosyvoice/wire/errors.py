"""The closed set of wire error codes, one exception class each."""

from __future__ import annotations


class CosyvoiceError(Exception):
    """Base of every error a client can be told about; ``code`` goes on the wire."""

    code = "internal"

    def __init__(self, msg: str, seq: int | None = None):
        super().__init__(msg)
        self.msg = msg
        self.seq = seq

    def to_wire(self) -> dict:
        data: dict[str, str | int] = {"code": self.code, "msg": self.msg}
        if self.seq is not None:
            data["seq"] = self.seq
        return data


class BadChunk(CosyvoiceError):
    code = "bad_chunk"


class TooLarge(CosyvoiceError):
    code = "too_large"


class SeqGap(CosyvoiceError):
    code = "seq_gap"

    def __init__(self, expected: int, got: int):
        super().__init__(f"expected seq {expected}, got {got}", seq=got)
        self.expected = expected

    def to_wire(self) -> dict:
        data = super().to_wire()
        data["expected"] = self.expected
        return data


class UnsupportedRate(CosyvoiceError):
    code = "unsupported_rate"


class UnsupportedMode(CosyvoiceError):
    code = "unsupported_mode"


class UnsupportedLanguage(CosyvoiceError):
    code = "unsupported_language"


class UnsupportedCodec(CosyvoiceError):
    code = "unsupported_codec"


class BadPacket(CosyvoiceError):
    code = "bad_packet"


class RateLimited(CosyvoiceError):
    code = "rate_limited"

    def __init__(self, msg: str, seq: int | None = None, retry_after_ms: int | None = None):
        super().__init__(msg, seq)
        self.retry_after_ms = retry_after_ms

    def to_wire(self) -> dict:
        data = super().to_wire()
        if self.retry_after_ms is not None:
            data["retry_after_ms"] = self.retry_after_ms
        return data


class Overloaded(CosyvoiceError):
    code = "overloaded"

    def __init__(self, msg: str, retry_after_ms: int):
        super().__init__(msg)
        self.retry_after_ms = retry_after_ms

    def to_wire(self) -> dict:
        return {**super().to_wire(), "retry_after_ms": self.retry_after_ms}


class Unauthorized(CosyvoiceError):
    code = "unauthorized"


class SessionExpired(CosyvoiceError):
    code = "session_expired"


class SessionLost(CosyvoiceError):
    """The session store lost the session (a Redis restarted without persistence): the
    audio it held is gone; a new session follows on the same connection."""
    code = "session_lost"


class IdleTimeout(CosyvoiceError):
    code = "idle_timeout"


class Unavailable(CosyvoiceError):
    code = "unavailable"


class Internal(CosyvoiceError):
    code = "internal"


ERROR_CODES = tuple(
    cls.code
    for cls in (BadChunk, BadPacket, TooLarge, SeqGap, UnsupportedRate, UnsupportedMode,
                UnsupportedLanguage, UnsupportedCodec, RateLimited, Overloaded, Unauthorized,
                SessionExpired, SessionLost, IdleTimeout, Unavailable, Internal)
)

"""What the bus answers besides plain values: an append's status, an admission, an
announcement, and a reply's string."""

from __future__ import annotations

from dataclasses import dataclass


class AppendStatus:
    APPENDED = 0
    DUPLICATE = 1
    NO_SESSION = -1
    GAP = -3
    ENDED = -4


@dataclass(frozen=True)
class AppendResult:
    status: int
    next_seq: int


@dataclass(frozen=True)
class Admission:
    """The outcome of ``Bus.admit``: the announcement, or how full the service was."""

    admitted: bool
    announcement: str | None
    open_sessions: int | None
    capacity: int


@dataclass(frozen=True)
class Announcement:
    msg_id: str
    sid: str


def text(value: bytes | str) -> str:
    """A reply's string: this package's clients return bytes (no ``decode_responses``);
    redis-py's types also allow str."""
    return value.decode() if isinstance(value, bytes) else value

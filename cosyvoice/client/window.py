"""The client's send rule (``SendWindow``): which chunk goes next, and when."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..wire.protocol import CHUNK_MS

# Chunks sent and not yet acknowledged, at most.
MAX_IN_FLIGHT = 64


@dataclass
class SendWindow:
    """Which chunk to send next, and when: the client's send rule, pure (no I/O, no clock
    of its own). Chunks ``acked`` and below are stored by the server; ``next`` is the
    next one to send; at most ``limit`` are sent and not acknowledged beyond the chunks
    the path's shortest round trip seen so far holds (``min_rtt_s``): a 2 s round trip
    holds ten 200 ms chunks before a single one queues."""

    next: int = 0
    acked: int = -1
    pause_until: float = 0.0
    limit: int = MAX_IN_FLIGHT  # chunks sent and not acknowledged, beyond the round trip
    min_rtt_s: float | None = None
    # Until the first ack: how long the connection's handshake took, at least one round trip
    # (about two), so a long path does not stall the first round trip's chunks and then
    # send them in one burst (which a narrow link would queue, and adaptive bitrate read
    # as congestion).
    handshake_s: float | None = None

    def start(self, next_seq: int) -> None:
        """A ``session`` event: the server has every chunk before ``next_seq``."""
        self.next, self.acked = next_seq, next_seq - 1

    def ack(self, seq: int, rtt_s: float | None = None) -> None:
        self.acked = max(self.acked, seq)
        if rtt_s is not None and rtt_s >= 0:
            self.min_rtt_s = rtt_s if self.min_rtt_s is None else min(self.min_rtt_s, rtt_s)

    @property
    def in_flight(self) -> int:
        """Chunks that may be sent and not acknowledged now."""
        rtt_s = self.min_rtt_s if self.min_rtt_s is not None else self.handshake_s
        return self.limit + math.floor((rtt_s or 0.0) * 1000 / CHUNK_MS)

    def rewind(self, seq: int, now: float, pause_s: float = 0.0) -> None:
        """Send again from ``seq`` (the server asked for it), after ``pause_s``."""
        self.next = min(self.next, seq)
        if pause_s:
            self.pause_until = now + pause_s

    def done(self, total: int) -> bool:
        return self.acked >= total - 1

    def wait(self, total: int, now: float, start: float, realtime: bool) -> float:
        """Seconds to wait before sending ``next`` (0 or less: send it now)."""
        if self.next >= total:
            return 0.2  # everything is sent: wait for acks (or a rewind)
        if self.next - self.acked > self.in_flight:
            return 0.05
        waits = [self.pause_until - now]
        if realtime:
            waits.append(start + self.next * CHUNK_MS / 1000 - now)
        return max(waits)

    def take(self) -> int:
        seq, self.next = self.next, self.next + 1
        return seq

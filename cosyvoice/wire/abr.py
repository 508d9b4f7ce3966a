"""Adaptive bitrate: which encodings ("rungs") a client may stream its audio in, the rung a
connection starts on (``start_rung``, from the client's network hint), the decision the
gateway relays (``Decision``) and the rules' settings (``Config``). Pure: nothing here reads
a clock or touches a socket. What decides a switch, one ``Estimator`` per connection, is in
cosyvoice/wire/abr_estimator.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard


@dataclass(frozen=True)
class Rung:
    """One encoding a client can stream: what to tell it, and what it costs on the wire."""

    name: str
    codec: str
    # Bit/s of audio payload the encoder produces.
    bitrate: int
    sample_rate: int
    # Bit/s on the wire including protobuf, Socket.IO and WebSocket framing.
    wire_bps: int

    def to_wire(self) -> dict[str, Any]:
        """The encoding as a message to the client carries it."""
        return {"codec": self.codec, "bitrate": self.bitrate, "sample_rate": self.sample_rate}


# Framing on the wire on top of a chunk's payload: Socket.IO's placeholder frame and the
# WebSocket and TCP/IP headers, about 150 bytes a chunk, 6 kbit/s at five chunks a second.
CHUNK_FRAMING_BYTES = 150
OPUS_FRAMING_BPS = CHUNK_FRAMING_BYTES * 8 * 5
# 16 kHz PCM on the wire: 256 kbit/s of samples and the same framing, in more TCP segments.
PCM16_WIRE_BPS = 270_000


def rungs_for(codecs: Sequence[str], bitrates: Sequence[int]) -> tuple[Rung, ...]:
    """The rungs a server offers, highest first: 16 kHz PCM where it takes PCM, then Opus at
    each of its bitrates. 16 kHz everywhere: the engines take 16 kHz, and 8 kHz PCM (or
    mu-law) costs more bits than Opus at 32 kbit/s and far more WER."""
    rungs = [Rung("pcm16", "pcm16", 256_000, 16_000, PCM16_WIRE_BPS)] if "pcm16" in codecs else []
    if "opus" in codecs:
        rungs += [Rung(f"opus{b // 1000}", "opus", b, 16_000, b + OPUS_FRAMING_BPS)
                  for b in sorted(bitrates, reverse=True)]
    return tuple(rungs)


# The default offer (COSYVOICE_CODECS, COSYVOICE_OPUS_BITRATES)
RUNGS: tuple[Rung, ...] = rungs_for(("pcm16", "opus"), (32_000, 24_000, 16_000, 12_000))


def rung_named(name: str, rungs: Sequence[Rung] = RUNGS) -> Rung:
    """The rung called ``name``; KeyError if there is none."""
    for rung in rungs:
        if rung.name == name:
            return rung
    raise KeyError(f"no rung named {name!r}")


def rung_for(codec: str, bitrate: float, rungs: Sequence[Rung] = RUNGS) -> Rung | None:
    """The rung of ``codec`` whose bitrate is nearest ``bitrate``; None for an unknown codec."""
    matching = [rung for rung in rungs if rung.codec == codec]
    if not matching:
        return None
    if not is_number(bitrate):
        return matching[0]
    return min(matching, key=lambda rung: abs(rung.bitrate - bitrate))


@dataclass(frozen=True)
class Decision:
    """Tell the client to switch to ``rung``."""

    # "down" or "up".
    direction: str
    rung: Rung
    # "congestion" (the queue grew), "probe_failed" (back from a probe) or "probe".
    reason: str


# navigator.connection.effectiveType values that cap the first rung: Chromium's "slow-2g"/"2g"
# mean tens of kbit/s, "3g" a few hundred (Slow 3G uplink 400 kbit/s, Fast 3G 675).
_LOWEST_OPUS_TYPES = frozenset({"slow-2g", "2g"})
_OPUS_TYPES = frozenset({"3g"})
_KNOWN_TYPES = _LOWEST_OPUS_TYPES | _OPUS_TYPES | {"4g"}
# Share of the browser's downlink estimate the first rung may use: it measures the downlink,
# and uplinks are usually slower.
_HINT_DOWNLINK_SHARE = 0.5


def start_rung(
    network_hint: Mapping[str, Any] | None, rungs: Sequence[Rung] = RUNGS
) -> tuple[Rung, str]:
    """The rung to start a connection on, and why ("network_hint" or "default").

    ``network_hint`` mirrors the browser's ``navigator.connection``: ``effective_type``,
    ``downlink_mbps`` and ``rtt_ms``, any of them missing or junk. The round-trip time says
    nothing about uplink capacity and is not used. Never raises.
    """
    if not isinstance(network_hint, Mapping):
        return rungs[0], "default"
    index: int | None = None
    kind = network_hint.get("effective_type")
    kind = kind.strip().lower() if isinstance(kind, str) else None
    if kind in _LOWEST_OPUS_TYPES:
        index = _lowest_opus(rungs)
    elif kind in _OPUS_TYPES:
        index = _highest_opus(rungs)
    elif kind in _KNOWN_TYPES:
        index = 0
    downlink = network_hint.get("downlink_mbps")
    if is_number(downlink) and downlink > 0:
        fitting = highest_fitting(rungs, downlink * 1e6 * _HINT_DOWNLINK_SHARE)
        index = fitting if index is None else max(index, fitting)
    if index is None:
        return rungs[0], "default"
    return rungs[index], "network_hint"


def is_number(value: object) -> TypeGuard[float]:
    """A finite int or float (bool excluded): what a junk hint or stamp is not."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def highest_fitting(rungs: Sequence[Rung], budget_bps: float) -> int:
    """Index of the highest rung whose wire rate fits ``budget_bps``; the lowest if none does."""
    for index, rung in enumerate(rungs):
        if rung.wire_bps <= budget_bps:
            return index
    return len(rungs) - 1


def _lowest_opus(rungs: Sequence[Rung]) -> int:
    opus = [index for index, rung in enumerate(rungs) if rung.codec == "opus"]
    return opus[-1] if opus else len(rungs) - 1


def _highest_opus(rungs: Sequence[Rung]) -> int:
    opus = [index for index, rung in enumerate(rungs) if rung.codec == "opus"]
    return opus[0] if opus else len(rungs) - 1


@dataclass(frozen=True)
class Config:
    """Tunables of :class:`Estimator`, each with the reason for its default."""

    # How long the minimum one-way delay is remembered (LEDBAT's 10 min). It must outlast any
    # standing queue, or the queue is taken for the base and the link for calm; the price is
    # that a route change to a longer path reads as queueing until it ages out.
    base_window_s: float = 600.0
    # Width of one bucket of that history: memory stays at window/bucket + 1 minima.
    base_bucket_s: float = 10.0
    # Queueing delay that means congestion. Well above the jitter band (a 150 ms path with
    # +-50 ms jitter swings 100 ms), and still a delay a listener barely notices.
    high_delay_ms: float = 300.0
    # Queueing delay below which the queue counts as empty: the jitter band. Calm (for probing)
    # and drained (after a switch) mean below it; a chunk above it stood in a queue.
    low_delay_ms: float = 100.0
    # Chunks in a row above high_delay_ms before switching down (600 ms of audio): one late
    # chunk or a jitter spike never switches.
    debounce_chunks: int = 3
    # ... and the first and last of that run sent at least this far apart (two chunks' time).
    # A client whose acks came late (on a slow uplink the TCP acknowledgements of the
    # downlink wait in the same queue) sends what waited in one burst, and a burst queues
    # behind itself for a moment on any link slower than a burst: that says nothing about
    # the rate the link carries. A queue that stands while chunks go at their pace does.
    debounce_s: float = 0.4
    # Share of the measured delivery rate a rung may use, for jitter in the measurement and
    # other traffic on the link.
    headroom: float = 0.75
    # Delivery rate: measured over the last rate_window_s of chunks that stood in a queue, once
    # they span rate_min_span_s (+-50 ms of jitter over 1 s is a 10 % error, inside headroom).
    rate_window_s: float = 3.0
    rate_min_span_s: float = 1.0
    # How long a delivery rate vetoes a probe it says cannot fit. Mobile capacity changes over
    # tens of seconds; after a minute the estimate no longer holds the probe back.
    rate_fresh_s: float = 60.0
    # After a switch down, how long to wait before judging the new rung by its own chunks'
    # trend: enough for them to arrive through a backlog of a few seconds.
    freeze_timeout_s: float = 10.0
    # Rise of the new rung's queue (above its lowest since the switch) that proves the new rung
    # does not fit either: the jitter band, so jitter alone never steps down twice.
    growth_margin_ms: float = 100.0
    # Calm needed at a rung before probing one rung up; doubled after each failed probe up to
    # probe_wait_max_s, so a link that cannot carry the next rung is probed a handful of times
    # an hour. A probe that fails costs a second or two of extra delay.
    probe_wait_s: float = 20.0
    probe_wait_max_s: float = 600.0
    # A queue rising past high_delay_ms this soon after the probe's first chunk means the probe
    # rung does not fit: back to the previous rung.
    probe_check_s: float = 5.0
    # A probe that survives this long resets the wait; congestion before then still doubles it.
    probe_hold_s: float = 30.0
    # A client send stamp that steps back by more than this is a restarted clock: the delay
    # history starts over. Smaller steps back are out-of-order chunks, ignored.
    clock_reset_ms: float = 1000.0

    def __post_init__(self) -> None:
        positive = {
            name: getattr(self, name)
            for name in (
                "base_window_s", "base_bucket_s", "high_delay_ms", "rate_window_s",
                "rate_min_span_s", "probe_wait_s", "probe_wait_max_s", "clock_reset_ms",
            )
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if not 0 <= self.low_delay_ms < self.high_delay_ms:
            raise ValueError("need 0 <= low_delay_ms < high_delay_ms")
        if self.debounce_chunks < 1:
            raise ValueError("debounce_chunks must be at least 1")
        if not self.debounce_s >= 0:
            raise ValueError("debounce_s must not be negative")
        if not 0 < self.headroom <= 1:
            raise ValueError("headroom must be in (0, 1]")

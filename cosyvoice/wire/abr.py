"""Adaptive bitrate: which encoding ("rung") a client should stream its audio in.

Pure decision logic, one :class:`Estimator` per connection: the gateway feeds it every chunk's
client send stamp, arrival time (the gateway's monotonic clock), wire size and encoding, and
relays the :class:`Decision` it returns, if any, to the client. Nothing here reads a clock or
touches a socket.

Over TCP an uplink that cannot carry the stream shows no loss, only one-way delay that grows
without bound. The estimator follows LEDBAT (RFC 6817): the queueing delay is the one-way delay
minus its minimum over a long history (the clocks need no sync, only differences count). A
queue standing above ``high_delay_ms`` for a few chunks switches down, to the highest rung that
fits the delivery rate measured while the queue stood (back-to-back arrivals from a backlog
reveal the link's capacity). After calm at a rung it probes one rung up, backing off
exponentially when probes fail.

Phases of one estimator:

* steady: judge every chunk; switch down on congestion, probe up after calm.
* draining (after any switch down): no decisions until chunks of the new rung arrive and the
  queue drains. The old rung's backlog still in the pipe says nothing about the new rung, so
  only the new rung's own chunks are judged: after ``freeze_timeout_s`` it steps down again
  only if their queue keeps growing. A client that never sends the new rung gets no more.
* probing (after a switch up): no decisions until the probe's chunks arrive; a queue that rises
  within ``probe_check_s`` of them sends it straight back ("probe_failed").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
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
    if not _is_number(bitrate):
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
    if _is_number(downlink) and downlink > 0:
        fitting = _highest_fitting(rungs, downlink * 1e6 * _HINT_DOWNLINK_SHARE)
        index = fitting if index is None else max(index, fitting)
    if index is None:
        return rungs[0], "default"
    return rungs[index], "network_hint"


def _is_number(value: object) -> TypeGuard[float]:
    """A finite int or float (bool excluded): what a junk hint or stamp is not."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _highest_fitting(rungs: Sequence[Rung], budget_bps: float) -> int:
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


class BaseDelay:
    """Minimum one-way delay over the last ``window_s``, in ``bucket_s`` buckets of minima."""

    def __init__(self, window_s: float, bucket_s: float) -> None:
        self._window_s = window_s
        self._bucket_s = bucket_s
        # (bucket number, minimum delay in it), oldest first.
        self._buckets: deque[tuple[int, float]] = deque()

    def __len__(self) -> int:
        return len(self._buckets)

    def add(self, at_s: float, delay_ms: float) -> float:
        """Record one delay sample taken at ``at_s``; return the base, this sample included."""
        number = math.floor(at_s / self._bucket_s)
        if self._buckets and self._buckets[-1][0] >= number:
            last, low = self._buckets[-1]
            self._buckets[-1] = (last, min(low, delay_ms))
        else:
            self._buckets.append((number, delay_ms))
        # A bucket goes once all of it is older than the window.
        oldest_kept = math.floor((at_s - self._window_s) / self._bucket_s)
        while self._buckets[0][0] < oldest_kept:
            self._buckets.popleft()
        return min(low for _, low in self._buckets)

    def reset(self) -> None:
        self._buckets.clear()


# A cap on the delivery window, for a stalled link that delivers a burst of chunks at once.
_MAX_RATE_SAMPLES = 512


class DeliveryRate:
    """Bytes per second arriving while a queue stands, from consecutive queued chunks."""

    def __init__(self, window_s: float, min_span_s: float) -> None:
        self._window_s = window_s
        self._min_span_s = min_span_s
        # (arrival, bytes) of the queued chunks in a row; the first one only marks the start.
        self._samples: deque[tuple[float, int]] = deque()
        self._bytes_after_first = 0
        self.bps: float | None = None
        self.measured_at: float | None = None
        # Whether bps comes from the queue standing now.
        self.current = False

    def add(self, arrival_s: float, nbytes: int, queued: bool) -> None:
        """Count one chunk; ``queued``: it stood behind a queue, so arrived back to back."""
        if not queued:
            self.end_run()
            return
        if self._samples:
            self._bytes_after_first += nbytes
        self._samples.append((arrival_s, nbytes))
        while len(self._samples) > 2 and (
            arrival_s - self._samples[1][0] >= self._window_s
            or len(self._samples) > _MAX_RATE_SAMPLES
        ):
            self._samples.popleft()
            self._bytes_after_first -= self._samples[0][1]
        span = arrival_s - self._samples[0][0]
        if len(self._samples) >= 2 and span >= self._min_span_s:
            self.bps = self._bytes_after_first * 8 / span
            self.measured_at = arrival_s
            self.current = True

    def end_run(self) -> None:
        """The queue is gone: keep the last estimate, start the next run afresh."""
        self._samples.clear()
        self._bytes_after_first = 0
        self.current = False

    def forget(self) -> None:
        """Drop the estimate too (the clock it was stamped with is gone)."""
        self.end_run()
        self.bps = None
        self.measured_at = None


class _Phase(Enum):
    STEADY = "steady"
    DRAINING = "draining"
    PROBING = "probing"


class Estimator:
    """Adaptive-rate decisions for one connection; see the module docstring."""

    def __init__(
        self, rung: Rung, *, rungs: Sequence[Rung] = RUNGS, config: Config | None = None
    ) -> None:
        if not rungs:
            raise ValueError("need at least one rung")
        if rung not in rungs:
            raise ValueError(f"rung {rung.name!r} is not among the rungs")
        self._rungs = tuple(rungs)
        self._config = config or Config()
        self._index = self._rungs.index(rung)
        self._base = BaseDelay(self._config.base_window_s, self._config.base_bucket_s)
        self._recent_ms: deque[float] = deque(maxlen=self._config.debounce_chunks)
        # Send stamp of the first chunk of the run above high_delay_ms now standing, if any.
        self._high_since_ms: float | None = None
        self._delivery = DeliveryRate(self._config.rate_window_s, self._config.rate_min_span_s)
        self._queue_ms = 0.0
        self._last_sent_ms: float | None = None
        self._last_arrival_s: float | None = None
        self._wait_s = self._config.probe_wait_s
        self._phase = _Phase.STEADY
        self._switched_at = 0.0
        # Draining: how many of the new rung's chunks arrived, and their lowest queue.
        self._new_rung_chunks = 0
        self._new_rung_min_ms = math.inf
        # Probing: arrival of the probe's first chunk.
        self._probe_arrived_at: float | None = None
        # After a probe's check: until when congestion still counts against the probe.
        self._probe_hold_until: float | None = None
        self._calm_since: float | None = None

    @property
    def rungs(self) -> tuple[Rung, ...]:
        """Every rung, highest first."""
        return self._rungs

    @property
    def rung(self) -> Rung:
        """The rung the client was last told to use."""
        return self._rungs[self._index]

    @property
    def queue_delay_ms(self) -> float:
        """Queueing delay of the latest chunk (one-way delay above the base), for a metric."""
        return self._queue_ms

    @property
    def delivery_bps(self) -> float | None:
        """Latest delivery rate measured while a queue stood, None before the first."""
        return self._delivery.bps

    @property
    def probe_wait_s(self) -> float:
        """Calm needed before the next probe up."""
        return self._wait_s

    @property
    def base_buckets(self) -> int:
        """Buckets of base-delay history held: at most base_window_s / base_bucket_s + 1."""
        return len(self._base)

    def on_chunk(
        self, sent_ms: float, arrival_s: float, nbytes: int, rung_name: str
    ) -> Decision | None:
        """Judge one arrived chunk; return a switch to tell the client about, or None.

        ``sent_ms``: the client's send stamp (any offset); ``arrival_s``: the gateway's
        monotonic clock; ``nbytes``: the chunk's wire size; ``rung_name``: the encoding it was
        sent with. Junk (non-finite stamps, negative sizes) never raises.
        """
        if not self._accept_clocks(sent_ms, arrival_s):
            return None
        size = int(nbytes) if _is_number(nbytes) and nbytes > 0 else 0
        self._measure(float(sent_ms), float(arrival_s), size)
        if self._phase is _Phase.DRAINING:
            return self._while_draining(arrival_s, rung_name)
        if self._phase is _Phase.PROBING:
            return self._while_probing(arrival_s, rung_name)
        return self._while_steady(arrival_s)

    # ---- measurement ------------------------------------------------------------------

    def _accept_clocks(self, sent_ms: float, arrival_s: float) -> bool:
        """Whether to use the chunk; restarts what a clock that stepped back invalidates."""
        if not (_is_number(sent_ms) and _is_number(arrival_s)):
            return False
        if self._last_arrival_s is not None and arrival_s < self._last_arrival_s:
            self._restart(arrival_s)
        elif self._last_sent_ms is not None and sent_ms < self._last_sent_ms:
            if self._last_sent_ms - sent_ms <= self._config.clock_reset_ms:
                return False
            self._forget_delays()
        self._last_sent_ms = sent_ms
        self._last_arrival_s = arrival_s
        return True

    def _measure(self, sent_ms: float, arrival_s: float, nbytes: int) -> None:
        delay_ms = arrival_s * 1000.0 - sent_ms
        self._queue_ms = delay_ms - self._base.add(arrival_s, delay_ms)
        self._recent_ms.append(self._queue_ms)
        if self._queue_ms <= self._config.high_delay_ms:
            self._high_since_ms = None
        elif self._high_since_ms is None:
            self._high_since_ms = sent_ms
        self._delivery.add(arrival_s, nbytes, self._queue_ms > self._config.low_delay_ms)

    def _forget_delays(self) -> None:
        """The client's clock restarted: delays before and after cannot be compared."""
        self._base.reset()
        self._recent_ms.clear()
        self._high_since_ms = None
        self._delivery.end_run()
        self._new_rung_chunks = 0
        self._new_rung_min_ms = math.inf

    def _restart(self, now: float) -> None:
        """The gateway's clock stepped back: every stamp is void; keep rung and wait."""
        self._forget_delays()
        self._delivery.forget()
        self._phase = _Phase.STEADY
        self._switched_at = now
        self._probe_arrived_at = None
        self._probe_hold_until = None
        self._calm_since = None

    def _floor_ms(self) -> float:
        """Lowest queueing delay of the last debounce_chunks chunks."""
        return min(self._recent_ms)

    def _congested(self) -> bool:
        """Whether the queue stood above high_delay_ms for debounce_chunks chunks in a row
        sent over at least debounce_s."""
        return (
            len(self._recent_ms) == self._config.debounce_chunks
            and self._floor_ms() > self._config.high_delay_ms
            and self._high_since_ms is not None
            and self._last_sent_ms is not None
            and self._last_sent_ms - self._high_since_ms >= self._config.debounce_s * 1000
        )

    def _drained(self) -> bool:
        return self._floor_ms() < self._config.low_delay_ms

    # ---- phases -----------------------------------------------------------------------

    def _while_steady(self, now: float) -> Decision | None:
        if self._probe_hold_until is not None and now >= self._probe_hold_until:
            self._probe_hold_until = None
            self._wait_s = self._config.probe_wait_s
        if self._congested():
            self._calm_since = None
            return self._step_down(now)
        if not self._drained():
            self._calm_since = None
        elif self._calm_since is None:
            self._calm_since = now
        if self._probe_due(now):
            return self._probe(now)
        return None

    def _while_draining(self, now: float, rung_name: str) -> Decision | None:
        if rung_name == self.rung.name:
            self._new_rung_chunks += 1
            self._new_rung_min_ms = min(self._new_rung_min_ms, self._queue_ms)
        if not self._new_rung_chunks:
            return None
        if self._drained():
            self._enter_steady(now)
            return None
        if now - self._switched_at >= self._config.freeze_timeout_s and self._still_growing():
            return self._step_down(now)
        return None

    def _while_probing(self, now: float, rung_name: str) -> Decision | None:
        if self._probe_arrived_at is None:
            if rung_name == self.rung.name:
                self._probe_arrived_at = now
            elif now - self._switched_at >= self._config.freeze_timeout_s:
                # The client never switched: judge what it does send.
                self._enter_steady(now)
            return None
        if self._congested():
            return self._probe_failed(now)
        if now - self._probe_arrived_at >= self._config.probe_check_s:
            self._probe_hold_until = self._probe_arrived_at + self._config.probe_hold_s
            self._enter_steady(now)
        return None

    def _still_growing(self) -> bool:
        """Whether the new rung's own chunks show a queue that is high and still rising: the
        last debounce_chunks of them all stand above their lowest by growth_margin_ms."""
        return (
            self._new_rung_chunks >= self._config.debounce_chunks
            and self._congested()
            and self._floor_ms() > self._new_rung_min_ms + self._config.growth_margin_ms
        )

    def _probe_due(self, now: float) -> bool:
        if self._index == 0 or self._calm_since is None:
            return False
        if now - self._calm_since < self._wait_s:
            return False
        return not self._rate_rules_out(self._rungs[self._index - 1], now)

    def _rate_rules_out(self, rung: Rung, now: float) -> bool:
        """Whether a fresh delivery rate says ``rung`` cannot fit. Measured on a link that was
        not saturated, the rate is only a lower bound, so a link with no estimate may probe."""
        bps, at = self._delivery.bps, self._delivery.measured_at
        if bps is None or at is None or now - at > self._config.rate_fresh_s:
            return False
        return rung.wire_bps > self._config.headroom * bps

    # ---- switches ---------------------------------------------------------------------

    def _step_down(self, now: float) -> Decision | None:
        """Switch down for congestion; at the lowest rung there is nothing to do."""
        target = self._down_target()
        if target == self._index:
            return None
        if self._probe_hold_until is not None:
            # The last probe did not survive: back off as for a failed probe.
            self._probe_hold_until = None
            self._back_off()
        self._switch(target, now, _Phase.DRAINING)
        return Decision("down", self.rung, "congestion")

    def _down_target(self) -> int:
        """The highest rung fitting the rate measured in the standing queue, or one down if
        there is no measurement; always at least one rung down, never below the lowest."""
        lowest = len(self._rungs) - 1
        one_down = min(self._index + 1, lowest)
        if not self._delivery.current or self._delivery.bps is None:
            return one_down
        budget = self._config.headroom * self._delivery.bps
        return max(one_down, _highest_fitting(self._rungs, budget))

    def _probe(self, now: float) -> Decision:
        self._switch(self._index - 1, now, _Phase.PROBING)
        return Decision("up", self.rung, "probe")

    def _probe_failed(self, now: float) -> Decision:
        self._back_off()
        self._switch(self._index + 1, now, _Phase.DRAINING)
        return Decision("down", self.rung, "probe_failed")

    def _back_off(self) -> None:
        self._wait_s = min(self._wait_s * 2, self._config.probe_wait_max_s)

    def _switch(self, index: int, now: float, phase: _Phase) -> None:
        self._index = index
        self._phase = phase
        self._switched_at = now
        self._new_rung_chunks = 0
        self._new_rung_min_ms = math.inf
        self._probe_arrived_at = None
        self._calm_since = None

    def _enter_steady(self, now: float) -> None:
        self._phase = _Phase.STEADY
        self._calm_since = now if self._drained() else None

"""Adaptive bitrate: when a connection should switch to another rung (cosyvoice/wire/abr.py).

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
from collections.abc import Sequence
from enum import Enum

from .abr import RUNGS, Config, Decision, Rung, highest_fitting, is_number


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
        size = int(nbytes) if is_number(nbytes) and nbytes > 0 else 0
        self._measure(float(sent_ms), float(arrival_s), size)
        if self._phase is _Phase.DRAINING:
            return self._while_draining(arrival_s, rung_name)
        if self._phase is _Phase.PROBING:
            return self._while_probing(arrival_s, rung_name)
        return self._while_steady(arrival_s)

    # ---- measurement ------------------------------------------------------------------

    def _accept_clocks(self, sent_ms: float, arrival_s: float) -> bool:
        """Whether to use the chunk; restarts what a clock that stepped back invalidates."""
        if not (is_number(sent_ms) and is_number(arrival_s)):
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
        return max(one_down, highest_fitting(self._rungs, budget))

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

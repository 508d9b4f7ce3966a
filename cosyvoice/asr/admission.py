"""How many sessions a worker process with a decode scheduler admits: what its scheduler
serves within the latency targets, measured while it runs.

A fixed capacity (``EngineSpec.capacity``, or ``cosyvoice worker --calibrate``) is right
only on the host and the load it was measured with: a host whose cores are shared with
other work, longer utterances or a slower model all change what a process can serve. A
whisper-live worker process instead reads its scheduler's load (``DecodeScheduler.sample``)
at every lease renewal and advertises the capacity this module computes from it:

- **Over target, step down.** If the 95th percentile of the recent finals' queue waits
  (hand-over to the start of their decode) is over ``final_wait_s``, that of the
  partials' (a session asking for a partial to its decode starting) over
  ``partial_wait_s``, or that of the finals' times from hand-over to text (the wait plus
  the decode) over ``final_s``, with two sessions or more, the capacity drops to one less
  than the sessions it decodes (one session's decodes wait only behind each other).
  Nobody is shed: the process admits no new session until it is back within the
  targets, and its sessions end in their own time. That many sessions is not tried
  again for ``HOLD`` renewals, twice as long each time it is over target again.
- **Within target, fill up to the measured fit.** A real-time session's share of the
  scheduler's time (busy fraction / real-time sessions over the last ``COST_WINDOW``
  samples) gives how many sessions keep the scheduler at ``busy`` (the fit). Real-time
  sessions are counted by the audio the worker fed its streams (audio seconds per wall
  second), so a file sent twice as fast as it plays counts as two, and a session that
  sends nothing as none: counting sessions, one file sent fast made a process look full
  and it kept that capacity once idle. For the same reason the queue waits of a sample fed
  more than ``BACKLOG_RATIO`` times its sessions' real-time audio are left out: a backlog
  caught up (a file sent fast, a take-over replaying) queues its own finals, which says
  nothing about how many microphones fit. While the process is full
  and within target, the capacity grows by one towards the fit once ``MIN_WAITS`` finals
  were measured at the current load, so a new session's cost shows before the next is
  admitted; where the fit is below the capacity (a slower host, longer utterances), it
  drops to the fit.
- Between 1 and ``ceiling``; an idle process keeps the capacity it had. It starts with the
  engine's measured capacity in the share of the host's cores that other work leaves
  (``start_capacity``: the pool samples the host while it loads its model,
  cosyvoice/worker/hostload.py), so a burst on a host already busy is not admitted at the quiet
  host's rate before anything is measured. Every change starts a new window of waits.

A wait in the queue is the first signal: it grows with the load alone. The final's time to
its text is the second: where finals decode at different speeds (the multilingual model's
take about twice as long as tiny.en's), the same wait means a later final, and judged by
the wait alone a process full of Mandarin sessions settled over the final target. Under
the encoder window's floor (15 s) a longer utterance's final costs little more: the
encoder's pass, most of it, is the same.

The targets are the scheduler's share of the service's latency targets (final P95 800 ms,
partial P95 1.5 s end to end; the rest is the endpointer's silence, the front end and
Redis), measured with ``benchmarks/admission.py`` (docs/engines.md, "Admission").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# Other work on the host below this many cores is noise (a shell, a log shipper, a test
# runner): the capacity starts at the engine's
OTHERS_IGNORED = 0.5
WINDOW = 40  # recent waits of each kind the percentiles are taken over
MIN_WAITS = 10  # fewer than this say nothing yet (the P95 of 5 is their maximum)
COST_WINDOW = 10  # recent samples the cost of a session is taken over
MIN_SAMPLES = 5  # samples with sessions before the cost says anything
# a sample whose streams were fed more than this many times their sessions' real-time
# audio was a backlog being caught up (a file sent fast, a take-over replaying): its queue
# waits say nothing about how many real-time sessions fit
BACKLOG_RATIO = 1.5
HOLD = 10  # renewals before trying again a capacity that was over target; doubled each
MAX_HOLD = 160  # time it is over target again, up to this


def start_capacity(capacity: int, cores: int, others: float | None) -> int:
    """The capacity a worker process starts with: the engine's ``capacity``, in the share
    of the pool's ``cores`` that other work (``others`` cores busy, cosyvoice/worker/hostload.py;
    None: not known) leaves it. From there it follows the scheduler as always: it grows
    back while the sessions are within target."""
    if others is None or others < OTHERS_IGNORED or cores < 1:
        return capacity
    return max(1, round(capacity * max(0.0, cores - others) / cores))


@dataclass(frozen=True)
class Targets:
    final_wait_s: float  # P95 of a final's wait in the queue (hand-over to its decode)
    partial_wait_s: float  # P95 of a session's wait for a partial decode to start
    busy: float  # the scheduler's busy fraction the fit aims at
    # P95 of a final's time from hand-over to its text (wait plus decode); None: not judged
    final_s: float | None = None


def p95(values) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


class Admission:
    """The capacity of one worker process, updated from its scheduler's load."""

    def __init__(self, start: int, ceiling: int, targets: Targets):
        self.ceiling = max(1, ceiling)
        self.capacity = max(1, min(start, self.ceiling))
        self.targets = targets
        self.finals: deque[float] = deque(maxlen=WINDOW)
        self.partials: deque[float] = deque(maxlen=WINDOW)
        self.final_times: deque[float] = deque(maxlen=WINDOW)
        # (busy, real-time sessions)
        self.loads: deque[tuple[float, float]] = deque(maxlen=COST_WINDOW)
        self.reason = "start"
        self.over_at: int | None = None  # the fewest sessions last seen over target
        self.hold = 0  # renewals before the capacity may reach ``over_at`` again
        self.next_hold = HOLD

    def over(self, sessions: int = 2) -> bool:
        """Over a target at ``sessions``, from two sessions on: one session's decodes wait
        only behind each other (a final behind its own partial, a backlog it sent) and take
        what they take (the host's speed, the model, the utterances' length), which
        admitting nobody else would not change."""
        if sessions < 2:
            return False
        t = self.targets
        return ((len(self.finals) >= MIN_WAITS and p95(self.finals) > t.final_wait_s)
                or (len(self.partials) >= MIN_WAITS and p95(self.partials) > t.partial_wait_s)
                or (t.final_s is not None and len(self.final_times) >= MIN_WAITS
                    and p95(self.final_times) > t.final_s))

    def measured(self) -> bool:
        """Enough finals at the current load to judge it (partials come several times as
        often, so they are always enough by then)."""
        return len(self.finals) >= MIN_WAITS

    @property
    def cost(self) -> float | None:
        """The scheduler's busy fraction a real-time session adds, over the recent samples."""
        if len(self.loads) < MIN_SAMPLES:
            return None
        sessions = sum(n for _, n in self.loads)
        return sum(b for b, _ in self.loads) / sessions if sessions > 0 else None

    def fit(self) -> int | None:
        cost = self.cost
        if cost is None:
            return None
        return max(1, math.floor(self.targets.busy / cost)) if cost > 0 else self.ceiling

    def _set(self, capacity: int, reason: str) -> int:
        """A new capacity: the waits so far were of the old load."""
        if capacity != self.capacity:
            self.capacity, self.reason = capacity, reason
            self._forget()
        return self.capacity

    def _forget(self) -> None:
        self.finals.clear()
        self.partials.clear()
        self.final_times.clear()

    def update(self, sessions: int, busy: float, final_waits: list[float],
               partial_waits: list[float], realtime: float | None = None,
               final_times: Sequence[float] = ()) -> int:
        """The capacity after one sample: ``busy`` fraction of the time decoding, the
        waits of the decodes done since the last sample and the finals' times from
        hand-over to text, with ``sessions`` decoded and ``realtime`` real-time sessions'
        worth of audio fed (None: ``sessions``)."""
        if realtime is None or realtime <= BACKLOG_RATIO * sessions:
            self.finals.extend(final_waits)
            self.partials.extend(partial_waits)
            self.final_times.extend(final_times)
        self.hold = max(0, self.hold - 1)
        if sessions == 0:
            self._forget()  # the next sessions' waits say what they cost
            return self.capacity
        self.loads.append((busy, sessions if realtime is None else realtime))
        if self.over(sessions):
            # not again soon, and each time it fails there, later
            self.over_at = sessions if self.over_at is None else min(self.over_at, sessions)
            self.hold, self.next_hold = self.next_hold, min(MAX_HOLD, 2 * self.next_hold)
            return self._set(max(1, min(self.capacity, sessions - 1)), "over target")
        fit = self.fit()
        if fit is None:
            return self.capacity
        if fit < self.capacity:
            return self._set(max(1, min(fit, self.ceiling)), "fit")
        if not self.measured():
            return self.capacity
        if self.over_at is not None and sessions >= self.over_at:
            self.over_at, self.next_hold = None, HOLD  # held there: that level is fine now
        grow = sessions >= self.capacity and self.capacity < min(fit, self.ceiling)
        if grow and (self.over_at is None or self.capacity + 1 < self.over_at
                     or self.hold == 0):
            return self._set(self.capacity + 1, "room")
        return self.capacity

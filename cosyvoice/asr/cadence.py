"""How often a worker process re-decodes its sessions' open utterances for partials: the
partial cadence, following the decode scheduler's load.

A whisper-live partial re-decodes the whole open utterance in a 7.5 s encoder window; a
final decodes an utterance once. On two cores partials are most of the decode time: at the
base cadence (one a second of speech) a process fills its scheduler at a dozen sessions,
while their finals alone would leave room for several times as many. So partials give way:

- **Demand against room.** The scheduler measures how long one partial decode takes
  (``partial_s``: its share of a batch, contention from other processes included), the
  fraction of its time finals take (``finals_busy``) and how many sessions are asking for
  partials (``asking``: sessions in speech). Partials may take what the finals leave of
  ``budget`` (the busy fraction the scheduler aims at); every asking session re-decoded
  once per interval takes ``asking * partial_s / interval`` of it, so the interval is
  ``asking * partial_s / (budget - finals_busy)``.
- **The wait.** Where partials still waited in the queue longer than ``wait_s`` (P95)
  since the last step (other work on the cores the measured costs did not see), the
  interval is at least one step longer than the one before, whatever the demand says.
- **Bounds.** Never shorter than ``base_s`` (``live_partial_interval_s``: the cadence of an
  idle service) and never longer than ``floor_s`` (``live_partial_floor_s``: the fewest
  partials a session in speech gets, at least one per that many seconds). A load the floor
  cannot keep within the targets is admission's to refuse (cosyvoice/asr/admission.py
  counts a session's partials at the floor, not at today's cadence).
- **Steps.** The interval moves in ``step_s`` steps (rounded up), so the ``load`` event a
  session gets when its cadence changes (``partial_interval_ms``) does not change with every
  sample.

Fairness is the scheduler's: every session asks at the same interval, and the waiting
partials are decoded oldest first (a newer partial of a session takes its waiting one's
place in the queue, not the back of it), so no session starves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The smallest share of the scheduler's time partials are given, where finals take (or
# measure as taking) all of the budget: the interval then goes to the floor.
MIN_ROOM = 0.05


@dataclass(frozen=True)
class Cadence:
    base_s: float  # the interval with room to spare
    floor_s: float  # the longest interval: at least one partial per this many seconds
    budget: float  # the scheduler's busy fraction partials and finals may fill together
    wait_s: float  # P95 of the partials' queue waits over which the interval grows
    step_s: float = 0.25


def partial_interval(c: Cadence, asking: float, partial_s: float, finals_busy: float,
                     wait_p95: float | None = None, previous: float | None = None) -> float:
    """The interval (s) between two partials of each session in speech, from the load:
    ``asking`` sessions in speech, ``partial_s`` scheduler seconds a partial decode takes,
    ``finals_busy`` the fraction of the time finals took, ``wait_p95`` the partials' recent
    queue waits (None: none measured) and the ``previous`` interval."""
    room = max(MIN_ROOM, c.budget - max(0.0, finals_busy))
    interval = max(0.0, asking) * max(0.0, partial_s) / room
    if wait_p95 is not None and previous is not None and wait_p95 > c.wait_s:
        interval = max(interval, previous + c.step_s)
    interval = math.ceil(round(interval / c.step_s, 6)) * c.step_s
    return min(c.floor_s, max(c.base_s, interval))

"""The sweeper: deletes sessions that nobody will end, one worker at a time.

A session normally ends by ``stop``, by its grace period after a disconnect, or by expiry
after ``last``; the sweeper catches the rest (a gateway that died without running its
disconnect handlers). Some worker runs it every ``SWEEP_INTERVAL_S``, under a lock, so
the workers of a whole deployment sweep once per interval between them.
"""

from __future__ import annotations

import logging
import time

from ..store import bus as busmod

log = logging.getLogger("cosyvoice.sweeper")

# How often some worker sweeps abandoned sessions (one at a time, by lock).
SWEEP_INTERVAL_S = 60.0
SWEEP_LOCK = "sweeper"


def sweep(bus: busmod.Bus, holder: str, idle_s: float, force: bool = False) -> int:
    """Delete the sessions whose audio saw no new entry for ``idle_s``; returns how many.

    ``holder`` takes the lock for one interval; without ``force`` nothing happens while
    another holder has it.
    """
    if not force and not bus.try_lock(SWEEP_LOCK, holder, int(SWEEP_INTERVAL_S * 1000)):
        return 0
    # Killed workers leave their consumers in the group; once their sessions were taken
    # over they hold nothing and are only clutter in every placement's scan.
    bus.forget_consumers(bus.dead_consumers())
    cutoff_ms = int((time.time() - idle_s) * 1000)
    swept, after = 0, "-"
    while True:
        batch = bus.announcements(after)
        if not batch:
            return swept
        activity = bus.last_activity_ms([a.sid for a in batch])
        for ann in batch:
            last = activity[ann.sid]
            if last is None or last < cutoff_ms:
                bus.sweep_session(ann.sid, ann.msg_id)
                swept += 1
                log.info("swept idle session", extra={"session": ann.sid, "event": "sweep"})
        after = batch[-1].msg_id

"""A worker's capacity, and the load it reports with its heartbeat.

A whisper-live worker's capacity follows what its decode scheduler measures
(cosyvoice/asr/admission.py), unless ``COSYVOICE_WORKER_CAPACITY`` fixes it; it starts in
the share of the cores that other work left the pool as it started. At each lease renewal
the worker hands this the scheduler's load since the last one (``follow``): the queue
waits, the busy fraction and the partial cadence go to the metrics and the heartbeat
(``report``, read back by ``GET /load``), and admission sets the capacity from them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from .. import metrics
from ..asr.admission import Admission, Targets, p95, start_capacity
from ..asr.scheduler import Load
from ..settings import Settings
from . import hostload

log = logging.getLogger("cosyvoice.worker")

# A capacity that follows the scheduler stays within this many times the engine's
# measured one (or --calibrate's): a guard against a cost estimate gone wrong
ADMISSION_CEILING = 3
# The recent queue waits of each kind a worker reports with its heartbeat (GET /load)
REPORTED_WAITS = 40


class Capacity:
    """How many sessions the worker holds (``value``) and what it reports of its load."""

    def __init__(self, settings: Settings, base: int, following: bool,
                 host_others: float | None = None):
        self.settings = settings
        self.value = base
        self.admission = (
            Admission(start_capacity(base, len(hostload.cores()), host_others),
                      ADMISSION_CEILING * base,
                      Targets(settings.final_wait_target_ms / 1000,
                              settings.partial_wait_target_ms / 1000,
                              settings.decode_busy_target,
                              settings.final_target_ms / 1000 or None))
            if following else None)
        if self.admission is not None:
            self.value = self.admission.capacity
        # audio seconds fed to the streams since the load was last sampled, and when that
        # was: how many real-time sessions' worth of audio the load came from
        self._fed_s = 0.0
        self._fed_since = time.monotonic()
        # the scheduler's recent queue waits and its partial cadence, for the heartbeat
        self._waits: dict[str, deque[float]] = {
            kind: deque(maxlen=REPORTED_WAITS) for kind in ("final", "partial")}
        self.report: dict | None = None

    def fed(self, seconds: float) -> None:
        """``seconds`` of audio went into the streams."""
        self._fed_s += seconds

    def follow_stage(self, stage: Any, sessions: int, embedder: Any | None) -> None:
        """Sample the engine's deferred stage (a scheduler reports a ``Load``; the finals
        process none) and, where the speaker embedder runs, its busy fraction too."""
        load = stage.sample()
        if isinstance(load, Load):
            self.follow(load, sessions, embedder.sample() if embedder is not None else None)

    def follow(self, load: Load, sessions: int, embed_busy: float | None = None) -> None:
        """The scheduler's load since the last call, with the speaker embedder's busy
        fraction (it shares the cores: its time counts as decoding's)."""
        if embed_busy is not None:
            load.busy += embed_busy
            load.final_busy += embed_busy  # a final's work, whatever the partials' cadence
        metrics.scheduler_load(load)
        self._waits["final"].extend(load.final_waits)
        self._waits["partial"].extend(load.partial_waits)
        self.report = {
            "busy": round(load.busy, 3),
            **{f"{kind}_wait_p95_ms": round(1000 * p95(w)) if w else None
               for kind, w in self._waits.items()},
            "partial_interval_ms": (round(1000 * load.partial_interval)
                                    if load.partial_interval else None)}
        now = time.monotonic()
        realtime = self._fed_s / (now - self._fed_since) if now > self._fed_since else None
        self._fed_s, self._fed_since = 0.0, now
        if self.admission is None:
            return
        # Admission counts what must be on time: the finals, and the partials at their
        # floor cadence, not at today's (cosyvoice/asr/cadence.py). While partials can
        # still be spaced out, their waits are the cadence's to answer, not admission's.
        floor = self.settings.live_partial_floor_s
        yielding = load.partial_interval is not None and load.partial_interval < floor
        before = self.value
        self.value = self.admission.update(sessions, load.at_floor(floor), load.final_waits,
                                           [] if yielding else load.partial_waits,
                                           realtime, load.final_times)
        if self.value != before:
            log.info("capacity %d -> %d (%s; %d sessions, busy %.2f a session)", before,
                     self.value, self.admission.reason, sessions,
                     self.admission.cost or 0.0)

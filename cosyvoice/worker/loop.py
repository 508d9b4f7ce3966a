"""ASR worker: owns sessions by lease and decodes each one's audio stream in order.

A worker with free capacity takes the sessions placement gives it (``Bus.place``:
announcements of the ``sessions`` stream, consumer group ``workers``, to the least-loaded
live worker), takes ``lease:{SID}`` with ``SET NX PX``, and from then on alone reads
``audio:{SID}`` from the session's checkpoint (or from the very first entry). It renews its
leases and keeps its announcements fresh; announcements whose owner died are claimed by
placement too. ``cosyvoice/worker/pool.py`` runs these loops in forked processes;
``cosyvoice/worker/sweeper.py`` deletes abandoned sessions.

The worker keeps the loop and the leases; what happens to a session's results is
elsewhere: the engine's deferred stage and the session's text stages
(cosyvoice/text/stages.py), and the order they are published in (cosyvoice/worker/outbox.py).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import cast

import redis

from .. import metrics
from ..asr import Model, capacity_of
from ..settings import Settings
from ..store import bus as busmod
from ..store.backoff import Backoff
from ..text import stages
from ..wire.chunk_pb import AudioChunkProto
from ..wire.codecs import SAMPLE_WIDTH
from ..wire.messages import Checkpoint, Decoded, End, ErrorResult, Finalized, Result
from ..wire.protocol import parse_stored
from ..wire.registry import ENGINES
from . import sweeper
from .capacity import Capacity
from .outbox import Ready, entry_results
from .sessions import LazyEmbedder, OwnedSession, open_session

log = logging.getLogger("cosyvoice.worker")

# Entries read per session per round: bounds the work between two lease renewals.
READ_COUNT = 5
# How long one XREAD waits for audio when the worker owns sessions.
READ_BLOCK_MS = 50
# How long a worker that owns no session waits for a new announcement per round.
IDLE_BLOCK_MS = 500
# Placement: a worker that is not the least loaded still takes a session that has waited
# this long, since the least loaded one may be in a long final or dead with a fresh
# heartbeat. Well above a healthy worker's round (50 ms plus its decoding).
PLACEMENT_DEFER_MS = 1000
# Every XREAD names each owned session, so its cost grows with their number while a round
# may find a single new chunk. Rounds are paced to at least this long per owned session
# (at most ROUND_PACE_MAX_S), so one round collects many chunks: nothing for a few
# sessions (5 → 0.25 ms), 20 ms for 400 (a null-engine worker in the transport benchmark).
ROUND_PACE_PER_SESSION_S = 50e-6
ROUND_PACE_MAX_S = 0.02
# A draining worker waits this long for the finals in hand before it hands sessions over
# (whatever is not done by then is decoded again by the next owner).
HANDOVER_FINALS_S = 10.0
# How long one XREAD waits while finals are being decoded: their results are published
# between reads.
FINALS_BLOCK_MS = 10


class Worker:
    """The decode loop of one worker process."""

    def __init__(self, settings: Settings, model: Model, client: redis.Redis,
                 worker_id: str | None = None, finals_process: bool = True,
                 host_others: float | None = None):
        self.settings = settings
        self.model = model
        self.bus = busmod.Bus(client, settings.stream_maxlen)
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.sessions: dict[str, OwnedSession] = {}
        self.accepting = True
        self._next_renew = 0.0
        self._next_autoclaim = 0.0
        self._next_sweep = time.monotonic() + sweeper.SWEEP_INTERVAL_S * 0.5
        self._last_round = 0.0
        self._newest_announcement = "0-0"
        # the connected sessions were caught up last round: the away ones are read too
        self._spare = True
        # Announcements this worker claimed from a dead owner whose lease had not lapsed
        # yet (the lease can outlive the announcement's idle time by one renewal): taken
        # again every lease renewal until it lapses (``_retry_unleased``)
        self._unleased: dict[str, busmod.Announcement] = {}
        self._next_unleased = 0.0
        # The engine's deferred stage (cosyvoice/text/stages.py; EngineSpec.stage): the 2-pass
        # finals process (or, ``finals_process=False``: tests that hold finals back, a
        # thread of this one), or whisper-live's decode scheduler
        spec = ENGINES[settings.engine]
        self.stage = model.start_stage(finals_process) if spec.stage else None
        # A scheduler's capacity follows what it serves, unless COSYVOICE_WORKER_CAPACITY
        # fixes it (``host_others``: cores other work kept busy as the pool started)
        self.load = Capacity(settings, capacity_of(settings),
                             spec.stage == "scheduler" and self.stage is not None
                             and not settings.worker_capacity, host_others)
        self._embedder = LazyEmbedder(inline=settings.speaker_embedder == "inline")

    @property
    def capacity(self) -> int:
        return self.load.value

    # ---- lifecycle --------------------------------------------------------------------

    def request_stop(self) -> None:
        """First SIGTERM: stop claiming, finish the chunks in hand, hand sessions over."""
        self.accepting = False

    def run(self) -> None:
        backoff = Backoff()
        group_ready = False
        while self.accepting:
            try:
                if not group_ready:
                    self.bus.ensure_group()
                    group_ready = True
                self._round()
                backoff.succeeded()
            except redis.RedisError as exc:
                # A restarted Redis has lost the consumer group: create it again.
                group_ready = group_ready and "NOGROUP" not in str(exc)
                backoff.wait(log, "redis error in worker loop", exc, time.sleep)
        self._hand_over()

    def _round(self) -> None:
        now = time.monotonic()
        pace = min(ROUND_PACE_MAX_S, ROUND_PACE_PER_SESSION_S * len(self.sessions))
        if now < self._last_round + pace:
            time.sleep(self._last_round + pace - now)
            now = time.monotonic()
        self._last_round = now
        self._renew_if_due()
        if self._unleased and self.accepting and now >= self._next_unleased:
            self._retry_unleased(now)
        if now >= self._next_sweep:
            self._next_sweep = now + sweeper.SWEEP_INTERVAL_S
            sweeper.sweep(self.bus, self.id, self.settings.sweep_idle_s)
        free = self.capacity - len(self.sessions) - len(self._unleased)
        if free > 0 and self.accepting:
            self._claim(now, free)
        waiting = self._publish_finals()
        if self.sessions:
            positions = {sid: s.position for sid, s in self.sessions.items()
                         if not s.ended and (self._spare or not s.away)}
            if positions:
                block = FINALS_BLOCK_MS if waiting else READ_BLOCK_MS
                self._decode_round(self.bus.read_audio(positions, READ_COUNT, block))
            else:
                self._spare = not self._connected_waiting()
                if waiting:
                    time.sleep(FINALS_BLOCK_MS / 1000)
        elif self.accepting:
            self.bus.wait_announcement(self._newest_announcement, IDLE_BLOCK_MS)

    def _decode_round(self, batch: dict[str, list[tuple[str, bytes]]]) -> None:
        """Decode what a read brought: the connected sessions' audio first; a session whose
        client is gone only once every connected one is caught up (none read a full batch,
        none has a final on its way), so clients that left cannot slow those still there
        (their results still wait for a resume)."""
        away = {sid for sid in batch if (s := self.sessions.get(sid)) is not None and s.away}
        here = {sid: entries for sid, entries in batch.items() if sid not in away}
        for sid, entries in here.items():
            self._decode_guarded(sid, entries)
        spare = (all(len(entries) < READ_COUNT for entries in here.values())
                 and not self._connected_waiting())
        if spare:  # (away sessions were read only because the last round was spare too)
            for sid in away:
                self._decode_guarded(sid, batch[sid])
        self._spare = spare

    def _connected_waiting(self) -> bool:
        return any(s.outbox.waiting for s in self.sessions.values() if not s.away)

    def _claim(self, now: float, free: int) -> None:
        """Take the sessions placement gives this worker (``Bus.place``); sessions whose
        owner died are looked for every ``claim_interval_ms``."""
        orphan_idle_ms = 0
        if now >= self._next_autoclaim:
            self._next_autoclaim = now + self.settings.claim_interval_ms / 1000
            orphan_idle_ms = self.settings.lease_ttl_ms
        self._newest_announcement, claimed = self.bus.place(
            self.id, self.capacity, free, orphan_idle_ms, PLACEMENT_DEFER_MS)
        for ann in claimed:
            self._adopt(ann)

    def _retry_unleased(self, now: float) -> None:
        """Adopt the claimed sessions whose dead owner's lease has lapsed since."""
        self._next_unleased = now + self.settings.lease_renew_ms / 1000
        for ann in list(self._unleased.values()):
            del self._unleased[ann.sid]
            self._adopt(ann)

    def _hand_over(self) -> None:
        """Publish the finals in hand, then release every session so another worker
        continues it from its checkpoint."""
        stage = self.stage
        if stage is not None:
            deadline = time.monotonic() + HANDOVER_FINALS_S
            try:  # the leases stay fresh meanwhile: nobody else decodes these sessions
                while self._publish_finals() and time.monotonic() < deadline:
                    self._renew_if_due()
                    stage.wait_idle(0.1)
            except redis.RedisError as exc:
                log.warning("could not publish the finals in hand: %s", exc)
            if ENGINES[self.settings.engine].stage == "finals":
                stage.stop()  # the finals process ends with this worker
        self._embedder.stop()
        for sid in list(self.sessions):
            s = self.sessions.pop(sid)
            self._drop(s)
            try:
                self.bus.release_lease(sid, self.id)
                self.bus.reannounce(sid, s.announcement)
            except redis.RedisError as exc:
                log.warning("could not hand over session %s: %s", sid, exc)
        try:
            self.bus.remove_worker(self.id)
        except redis.RedisError:
            pass
        log.info("worker %s stopped", self.id)

    # ---- ownership --------------------------------------------------------------------

    def _renew_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_renew:
            self._renew()
            self._next_renew = now + self.settings.lease_renew_ms / 1000

    def _renew(self) -> None:
        sids = list(self.sessions)
        for sid, status in self.bus.renew_leases(sids, self.id, self.settings.lease_ttl_ms).items():
            if status in (1, 2):
                self.sessions[sid].away = status == 2
                continue
            s = self.sessions.pop(sid)
            self._drop(s)
            if status == -1:
                log.info("session %s ended (keys gone)", sid, extra={"session": sid})
                self.bus.ack_announcement(s.announcement)
            else:
                log.warning("lost the lease of session %s", sid, extra={"session": sid})
        self.bus.touch_announcements(self.id, [s.announcement for s in self.sessions.values()])
        if self.stage is not None:
            self.load.follow_stage(self.stage, len(self.sessions), self._embedder.thread)
        self.bus.heartbeat(self.id, self.capacity, self.settings.lease_ttl_ms, self.load.report)
        metrics.worker_load(len(self.sessions), self.capacity)

    def _adopt(self, ann: busmod.Announcement) -> None:
        if ann.sid in self.sessions:
            return
        info = self.bus.session_info(ann.sid)
        checkpoint = Checkpoint.from_json(info["checkpoint"]) if "checkpoint" in info else None
        # a hash without its start rate is not a session a gateway created: nothing to
        # decode (a late write after the session was deleted, from an older version)
        if "start_rate" not in info or (checkpoint and checkpoint.done):
            self.bus.ack_announcement(ann.msg_id)
            return
        if not self.bus.take_lease(ann.sid, self.id, self.settings.lease_ttl_ms):
            # Its owner is live, or died less than a lease ago: the announcement is ours
            # now (no other worker claims it), so this worker tries again until it can
            # (a worker that stops first leaves it pending: another claims it a lease later)
            self._unleased[ann.sid] = ann
            return
        self.sessions[ann.sid] = session = open_session(
            ann, info, checkpoint, self.model, self.settings, self.bus,
            self._embedder, away=self.bus.client_gone(ann.sid))
        log.info("took session %s at seq %d", ann.sid, session.next_seq,
                 extra={"session": ann.sid, "event": "claim"})

    # ---- decoding ---------------------------------------------------------------------

    def _decode_guarded(self, sid: str, entries: list[tuple[str, bytes]]) -> None:
        """Decode, but let a failure end only its own session, with an error to the client."""
        try:
            self._decode(sid, entries)
        except redis.RedisError:
            raise
        except Exception:  # noqa: BLE001 - an engine bug must not take the worker down
            log.exception("decoding session %s failed", sid, extra={"session": sid})
            s = self.sessions.get(sid)
            if s is not None:
                self._fail(s, "decoding failed")

    def _fail(self, s: OwnedSession, msg: str) -> None:
        """End the session with an ``internal`` error to its client."""
        error = ErrorResult(type="error", code="internal", msg=msg)
        self.bus.publish_results(s.sid, [error], self.settings.result_ttl_s,
                                 Checkpoint.finished(), done=True)
        self._finish(s)

    def _decode(self, sid: str, entries: list[tuple[str, bytes]]) -> None:
        s = self.sessions.get(sid)
        if s is None:
            return
        for entry_id, pb in entries:
            msg = parse_stored(pb)
            if msg.seq != s.next_seq:
                # The gateway appends in seq order; anything else is a stale duplicate.
                log.warning("session %s: skipping seq %d, expected %d", sid, msg.seq, s.next_seq)
                s.position = entry_id
                continue
            decoded = self._feed(s, msg)
            if msg.last:
                decoded += s.stream.flush()
            elif msg.finalize:
                # every result of the audio so far, then the marker that says so
                decoded += [*s.stream.finalize(),
                            cast(Result, Finalized(type="finalized", seq=msg.seq))]
            results, checkpoint = entry_results(
                sid, entry_id, msg.seq, msg.last, decoded,
                lambda: {**s.stream.checkpoint, **(s.speakers.position if s.speakers else {})})
            s.position, s.next_seq = entry_id, msg.seq + 1
            if not self._publish_entry(s, entry_id, results, checkpoint, msg.last):
                self._finish(s)
                return
            if msg.last:
                s.ended = True
                if not s.outbox.waiting:
                    self._finish(s)
                return

    def _feed(self, s: OwnedSession, msg: AudioChunkProto) -> list[Decoded]:
        """Feed one chunk's audio (PCM, or Opus decoded to 16 kHz) to the stream."""
        decoded: list[Decoded] = []
        for pcm, rate in s.audio.pieces(msg):
            self.load.fed(len(pcm) / (SAMPLE_WIDTH * rate))
            if s.speakers is not None:
                s.speakers.feed(pcm, rate)
            decoded += s.stream.feed(pcm, rate)
        return decoded

    def _publish_entry(self, s: OwnedSession, entry_id: str, results: list[Decoded | End],
                       checkpoint: Checkpoint | None, last: bool) -> bool:
        """Run an entry's results through the session's text stages into its outbox and
        publish what may go out now. False when the session no longer exists."""
        if s.speakers is not None:
            results = s.speakers.wrap(results)
        ready = s.outbox.push(entry_id, stages.apply(s.rules, results), checkpoint, last)
        return self._publish(s, ready)

    def _publish(self, s: OwnedSession, ready: Ready) -> bool:
        metrics.observe_decode_lag(ready.entry_id, ready.results)
        return self.bus.publish_results(s.sid, ready.results, self.settings.result_ttl_s,
                                        ready.checkpoint, done=ready.done)

    def _publish_finals(self) -> bool:
        """Publish every session's deferred results that are decoded, in order, each
        entry with its checkpoint; True while some are still being decoded."""
        waiting = False
        for s in list(self.sessions.values()):
            for ready in s.outbox.ready():
                if ready.failed:
                    self._fail(s, "decoding a final failed")
                    break
                if not self._publish(s, ready) or ready.done:
                    self._finish(s)
                    break
            waiting = waiting or s.outbox.waiting
        return waiting

    def _drop(self, s: OwnedSession) -> None:
        """This process no longer decodes the session: its finals in hand are skipped."""
        s.outbox.clear()
        s.stream.close()

    def _finish(self, s: OwnedSession) -> None:
        self.sessions.pop(s.sid, None)
        self._drop(s)
        self.bus.release_lease(s.sid, self.id)
        self.bus.ack_announcement(s.announcement)
        log.info("session %s finished", s.sid, extra={"session": s.sid, "event": "finish"})

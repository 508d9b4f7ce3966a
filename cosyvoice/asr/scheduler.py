"""The decode scheduler of a worker process: whisper-live's decodes, finals first.

A whisper-live session needs a Whisper decode for each partial (the open utterance again,
about once a second) and for each final. Decoded in the worker's loop, one session after
the other, a final waited for every partial decode of the round in progress: on two cores
the loop held 10 real-time sessions and missed the final target at 12 with the CPU half
idle (docs/engines.md). Here the loop only runs the cheap front end (resampling, the VAD,
the endpointer) and hands each decode to the scheduler, a thread of the worker process:

- **Finals first.** A final is decoded as soon as the decode step in progress ends: the
  partials' work is cut into steps (each clip's encoder pass, then one ``generate`` for
  the batch), and the scheduler looks for a waiting final before each step. Finals of a
  session are decoded in order, each with the finals before it as its prompt, so they are
  the same whatever else the worker decodes (CTranslate2 on one thread is deterministic,
  and a batch does not change a clip's result: tests/unit/test_engines.py).
- **Partials coalesced.** A session has at most one partial waiting: a newer one replaces
  it (in its place in the queue: the waiting partials are decoded oldest first, so no
  session starves), and its final drops it (the utterance is over). So a worker that falls
  behind decodes fewer partials, on the newest audio, instead of a queue of stale ones.
- **Partials yield.** Every ``CADENCE_EVERY_S`` the scheduler sets ``partial_interval``,
  the interval its sessions ask for partials at, from its load (cosyvoice/asr/cadence.py):
  as the partials' demand outgrows what the finals leave of the scheduler's time, every
  session's partials are spaced out, down to the floor.
- **Batched.** Waiting partials that share a model and an encoder window are decoded as
  one batch, up to ``decode_batch`` (``COSYVOICE_DECODE_BATCH``; chosen by
  ``benchmarks/batching.py``).
  A partial of a session whose final is being decoded waits for it (its prompt and its
  utterance number come from that final).

The loop learns of results by polling the jobs (``done``); it publishes a session's
results in the order they were handed over, so a partial never follows its own final.
With ``decode_batch`` 0 there is no scheduler: every decode runs in the loop (``Inline``),
as before; tests and the direct decodes of the benchmarks decode that way too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .admission import p95
from .cadence import Cadence, partial_interval

log = logging.getLogger("cosyvoice.worker")

# How often the scheduler sets its partial cadence (while it decodes).
CADENCE_EVERY_S = 0.5
# The weight of the latest half second in the partial cost and the finals' share the
# cadence is set from (exponentially smoothed)
SMOOTHING = 0.3
# A session whose stream was in an utterance within this many seconds is counted as asking
# for partials (in speech): a pause between two utterances does not drop it.
ASKING_GRACE_S = 2.0


@dataclass
class StreamState:
    """What a session's decodes share, read and written only where decodes run (the
    scheduler's thread, or the loop when decoding inline)."""
    prompt: str = ""  # the session's finals so far (their end): the prompt of the next
    utterance: int = 0  # finals with text so far: the number of the open utterance
    hyp: list[str] = field(default_factory=list)  # the last partial's words
    last_partial: str = ""
    cancelled: bool = False  # the session is no longer this process's
    # the language the session asked for ("auto": detected), the one its utterances are
    # in now ("" until one is detected) and the one its prompt is in
    language: str = "en"
    current: str = "en"
    prompt_language: str = ""
    # the open utterance's language detection, where a partial made one: (utterance, prob)
    detected: tuple[int, float] | None = None
    finals_in_flight: int = 0  # finals handed over and not decoded yet (scheduler lock)


@dataclass
class DecodeJob:
    """One decode a stream asks for. ``result`` is filled in (or the job marked
    ``dropped``) by ``finish``, which the engine gives, once the decode is done; a job
    dropped before it is decoded is never finished."""
    kind: str  # "partial" | "final"
    state: StreamState
    pcm: bytes
    result: dict
    finish: Callable[["DecodeJob", Any], None]  # (job, Decoded)
    clip: Any = None  # the scheduler's: the prepared audio
    prompt: str = ""  # the prompt it was decoded with
    language: str = ""  # a partial's language, chosen when it is prepared ("": detected)
    utterance: int = 0  # the utterance it belongs to (set when it is decoded)
    done: bool = False
    failed: bool = False
    dropped: bool = False
    after: dict = field(default_factory=dict)  # checkpoint fields once this final is done
    # when the session began to wait for it (a partial that replaced a waiting one keeps
    # that one's time: the session has waited for a fresh partial since then)
    submitted: float = 0.0

    def drop(self) -> None:
        self.dropped = self.done = True


@dataclass
class Load:
    """What a scheduler did between two ``sample`` calls: the fraction of the wall time
    it was decoding, how long each final and each decoded partial waited in the queue,
    from hand-over to the start of its decode (seconds), and how long each final took from
    hand-over to its text (its wait plus its decode: what the final's latency gets from the
    scheduler, a slower model's decode included)."""
    busy: float
    final_waits: list[float]
    partial_waits: list[float]
    final_times: list[float] = field(default_factory=list)
    final_busy: float = 0.0  # the fraction of the wall time it was decoding finals
    # the interval its sessions asked for partials at, at the end of the sample (None:
    # the scheduler does not pace partials)
    partial_interval: float | None = None

    def at_floor(self, floor_s: float) -> float:
        """The busy fraction had every session asked for partials once per ``floor_s``
        (the cadence's floor) instead of ``partial_interval``: the finals' share as it
        was, the partials' scaled by the intervals (partials are paced per session, so
        their decodes go as one over the interval)."""
        if self.partial_interval is None:
            return self.busy
        partials = max(0.0, self.busy - self.final_busy)
        return self.final_busy + partials * min(1.0, self.partial_interval / floor_s)


class Inline:
    """No scheduler: each decode runs when it is asked for, in the caller's thread."""

    partial_interval: float | None = None  # the stream's own cadence

    def speaking(self, state: StreamState) -> None:
        pass

    def __init__(self, decode_final: Callable[[DecodeJob], Any],
                 decode_partial: Callable[[DecodeJob], Any]):
        self._final = decode_final
        self._partial = decode_partial

    def submit(self, job: DecodeJob) -> None:
        st = job.state
        job.prompt, job.utterance = st.prompt, st.utterance
        decode = self._final if job.kind == "final" else self._partial
        job.finish(job, decode(job))
        job.done = True


class DecodeScheduler:
    """The decode thread of one worker process (see the module's docstring).

    ``decode_final(job)``: a final's result; ``prepare(job)``: a partial's clip (its
    ``group``, the model and the encoder window, groups batches);
    ``decode_partials(jobs, between)``: results of a batch, calling ``between()`` after
    each step.
    """

    def __init__(self, decode_final: Callable[[DecodeJob], Any],
                 prepare: Callable[[DecodeJob], Any],
                 decode_partials: Callable[[list[DecodeJob], Callable[[], None]], list[Any]],
                 max_batch: int, start: Callable[[], None] | None = None,
                 cadence: Cadence | None = None):
        self._decode_final = decode_final
        self._prepare = prepare
        self._decode_partials = decode_partials
        self.max_batch = max(1, max_batch)
        self._start = start
        self.cadence = cadence
        # the interval sessions ask for partials at now (None: their own, fixed cadence)
        self.partial_interval: float | None = cadence.base_s if cadence else None
        self._cond = threading.Condition()
        self._finals: deque[DecodeJob] = deque()
        self._partials: OrderedDict[int, DecodeJob] = OrderedDict()  # by id(state)
        self._busy = False
        self._stopping = False
        # what it did (the tests read these)
        self.batches = 0
        self.partials_decoded = 0
        self.partials_dropped = 0
        self.finals_decoded = 0
        # what it did since the last ``sample`` (admission reads it: cosyvoice/asr/admission.py)
        self._busy_s = 0.0
        self._sampled = time.monotonic()
        self._waits: dict[str, list[float]] = {"final": [], "partial": []}
        self._final_times: list[float] = []
        self._final_busy_s = 0.0
        # what it did since the cadence was last set (the decode thread's)
        self._asked: dict[int, float] = {}  # id(state) -> when it was last in speech (lock)
        self._c_since = time.monotonic()
        self._c_final_s = 0.0  # seconds decoding finals
        self._c_partial_s = 0.0  # seconds decoding partials (finals between steps aside)
        self._c_partials = 0
        self._c_waits: list[float] = []
        self._partial_cost: float | None = None  # seconds one partial decode takes
        self._finals_share = 0.0  # the fraction of the time finals take
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    # ---- the loop's side --------------------------------------------------------------

    def submit(self, job: DecodeJob) -> None:
        job.submitted = time.monotonic()
        with self._cond:
            key = id(job.state)
            if job.kind == "final":
                stale = self._partials.pop(key, None)
                job.state.finals_in_flight += 1
                self._finals.append(job)
            else:
                stale = self._partials.get(key)
                if stale is not None:
                    job.submitted = stale.submitted
                self._partials[key] = job  # a replacement keeps its place in the queue
            self._cond.notify_all()
        if stale is not None:  # replaced by a newer partial, or its utterance ended
            self.partials_dropped += 1
            stale.drop()

    def speaking(self, state: StreamState) -> None:
        """The session is in an utterance: it asks for partials (the cadence counts it)."""
        with self._cond:
            self._asked[id(state)] = time.monotonic()

    def cancel(self, state: StreamState) -> None:
        """The session is gone from this process: nothing of it is decoded any more."""
        with self._cond:
            state.cancelled = True
            stale = self._partials.pop(id(state), None)
            self._asked.pop(id(state), None)
        if stale is not None:
            stale.drop()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is waiting or being decoded; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._busy or self._finals or self._partials), timeout_s)

    def sample(self) -> Load:
        """The scheduler's load since the last call (one caller: the worker's loop)."""
        now = time.monotonic()
        with self._cond:
            busy_s, self._busy_s = self._busy_s, 0.0
            waits, self._waits = self._waits, {"final": [], "partial": []}
            times, self._final_times = self._final_times, []
            final_s, self._final_busy_s = self._final_busy_s, 0.0
            wall, self._sampled = now - self._sampled, now
        return Load(min(1.0, busy_s / wall) if wall > 0 else 0.0,
                    waits["final"], waits["partial"], times,
                    min(1.0, final_s / wall) if wall > 0 else 0.0, self.partial_interval)

    def _waited(self, job: DecodeJob, started: float) -> None:
        with self._cond:
            self._waits[job.kind].append(started - job.submitted)
            if job.kind == "partial":
                self._c_waits.append(started - job.submitted)

    def _pace(self) -> None:
        """Set the partial cadence from the load since it was last set (decode thread)."""
        now = time.monotonic()
        wall = now - self._c_since
        if self.cadence is None or wall < CADENCE_EVERY_S:
            return
        c = self.cadence
        # both smoothed over the last few settings: a half second holds few decodes
        if self._c_partials:
            cost = self._c_partial_s / self._c_partials
            self._partial_cost = cost if self._partial_cost is None else (
                (1 - SMOOTHING) * self._partial_cost + SMOOTHING * cost)
        self._finals_share = ((1 - SMOOTHING) * self._finals_share
                              + SMOOTHING * self._c_final_s / wall)
        with self._cond:
            horizon = now - ASKING_GRACE_S
            for key in [k for k, t in self._asked.items() if t < horizon]:
                del self._asked[key]
            asking = len(self._asked)
            waits, self._c_waits = self._c_waits, []
        previous = self.partial_interval
        self.partial_interval = partial_interval(
            c, asking, self._partial_cost or 0.0, self._finals_share,
            p95(waits) if waits else None, previous)
        if self.partial_interval != previous:
            log.debug("partial interval %.2f s -> %.2f s (%d sessions in speech, %.0f ms a "
                     "partial, finals %.0f%% busy)", previous or 0.0, self.partial_interval,
                     asking, 1000 * (self._partial_cost or 0.0), 100 * self._finals_share)
        self._c_since, self._c_final_s, self._c_partial_s, self._c_partials = now, 0.0, 0.0, 0

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- the decode thread ------------------------------------------------------------

    def _run(self) -> None:
        if self._start is not None:
            self._start()
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._stopping or self._finals
                                    or self._ready_partial() is not None)
                if self._stopping:
                    return
                self._busy = True
                final = self._finals.popleft() if self._finals else None
                batch = [] if final is not None else self._take_partials()
            started = time.monotonic()
            if final is not None:
                self._final(final)
            else:
                self._partial_batch(batch)
            with self._cond:
                self._busy_s += time.monotonic() - started
            self._pace()

    def _ready_partial(self) -> DecodeJob | None:
        for job in self._partials.values():
            if job.state.finals_in_flight == 0:
                return job
        return None

    def _take_partials(self) -> list[DecodeJob]:
        """Up to ``max_batch`` waiting partials, oldest first, that share the oldest's
        model and encoder window (``clip.group``) and whose sessions have no final being
        decoded (lock held)."""
        first = self._ready_partial()
        if first is None:
            return []
        batch: list[DecodeJob] = []
        for key, job in list(self._partials.items()):
            if len(batch) == self.max_batch:
                break
            if job.state.finals_in_flight:
                continue
            if job.clip is None:  # ``first`` is the first job this line is reached with
                job.clip = self._prepare(job)
            if job.clip.group != first.clip.group:  # one model, one encoder window
                continue
            del self._partials[key]
            st = job.state
            job.prompt, job.utterance = st.prompt, st.utterance
            batch.append(job)
        return batch

    def _between(self) -> None:
        """Between two steps of a partial batch: decode the finals waiting."""
        while True:
            with self._cond:
                final = self._finals.popleft() if self._finals else None
            if final is None:
                return
            self._final(final)

    def _final(self, job: DecodeJob) -> None:
        st = job.state
        started = time.monotonic()
        try:
            if st.cancelled:
                job.drop()
                return
            job.prompt, job.utterance = st.prompt, st.utterance
            try:
                decoded = self._decode_final(job)
            except Exception:  # noqa: BLE001 - a decoder bug ends its session, not the worker
                log.exception("decoding a final failed")
                job.failed = job.done = True
                return
            job.finish(job, decoded)
            job.done = True
            self.finals_decoded += 1
            self._waited(job, started)
            with self._cond:
                self._final_times.append(time.monotonic() - job.submitted)
        finally:
            took = time.monotonic() - started
            self._c_final_s += took
            with self._cond:
                self._final_busy_s += took
                st.finals_in_flight -= 1
                self._cond.notify_all()

    def _partial_batch(self, batch: list[DecodeJob]) -> None:
        started = time.monotonic()
        live = [j for j in batch if not j.state.cancelled]
        for job in batch:
            if job.state.cancelled:
                job.drop()
        if not live:
            return
        finals_before = self._c_final_s
        try:
            decoded = self._decode_partials(live, self._between)
        except Exception:  # noqa: BLE001 - a partial is not worth a session
            log.exception("decoding %d partials failed", len(live))
            for job in live:
                job.drop()
            return
        self.batches += 1
        self._c_partial_s += (time.monotonic() - started) - (self._c_final_s - finals_before)
        self._c_partials += len(live)
        for job, out in zip(live, decoded, strict=True):
            job.finish(job, out)
            job.done = True
            self.partials_decoded += 1
            self._waited(job, started)

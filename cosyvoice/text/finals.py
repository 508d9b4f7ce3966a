"""Whisper finals off the partials' path.

A worker process decodes every owned session's chunks in one loop: PocketSphinx, tens of
milliseconds a chunk. A Whisper final costs from several hundred milliseconds to seconds;
decoded inside that loop it held up every other session's partials. Here the loop hands each
final to the worker's finals stage and goes on; the stage decodes the finals one by one in
the order they were handed over (so a session's finals are decoded in utterance order, each
with the text before it as its prompt), and the loop publishes each one when it is done.

The stage is a thread of the worker that passes each final to the worker's own finals
process (``FinalProcess``), forked from it at start, so it maps the same model pages. A
thread alone is not enough: PocketSphinx holds the interpreter lock while it decodes a chunk,
so a finals thread's Python steps (openai-whisper's decoding loop) waited for every session's
partials. The finals process runs at a lower CPU priority (``finals_nice``), so on a busy
machine the partials get the CPU first. docs/benchmarks.md has the numbers.

Why not a separate stage fed through Redis: the session's owner stays the only writer of its
results and checkpoint, so the ownership guarantees hold as they are. A final is published
with the checkpoint of its own utterance's end, in utterance order, after every final before
it; a worker killed with finals in hand has stored no checkpoint past them, so whoever takes
the session over decodes them again from the audio, and none is sent twice. A finals process
that dies is started again and given the final it had (it holds nothing else); one that
outlives its worker is killed with it (``PR_SET_PDEATHSIG``).

Context: each session has a ``Context``, the text of its finals so far (its last
``PROMPT_MAX_CHARS``), given to Whisper as the prompt of its next final. The checkpoint
carries it, so a session taken over decodes with the same context.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import queue
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("cosyvoice.worker")

# The prompt: the end of the session's previous finals, cut at a word. Whisper reads at most
# 223 prompt tokens; 200 characters are about 45, the last sentence or two.
PROMPT_MAX_CHARS = 200
# A finals process that dies is started again and given the same final this many times.
PROCESS_TRIES = 3
PR_SET_PDEATHSIG = 1


def next_prompt(prompt: str, text: str) -> str:
    """The context after a final of ``text``: the last PROMPT_MAX_CHARS, whole words."""
    joined = f"{prompt} {text}".strip() if text else prompt
    if len(joined) <= PROMPT_MAX_CHARS:
        return joined
    cut = joined[-PROMPT_MAX_CHARS:]
    space = cut.find(" ")
    return cut[space + 1:] if space >= 0 else cut


@dataclass
class Context:
    """A session's context for its finals, shared by the loop and the finals stage."""
    prompt: str = ""
    cancelled: bool = False  # the session is no longer this process's: skip its finals


@dataclass
class Job:
    """One final to decode: its utterance's audio (16 kHz PCM). Once ``done``, ``result``
    holds its text and ``after`` the session's prompt from then on (a
    ``messages.Deferred``; the 2-pass stream returns it as a ``messages.Scheduled``)."""
    context: Context
    audio: bytes
    done: bool = False
    failed: bool = False
    dropped: bool = False  # never: a final's text is published even when empty
    result: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


class FinalProcess:
    """The finals process of one worker process: forked from it, so it shares the mapped
    model weights, and decoding there never waits for the worker's interpreter lock
    (PocketSphinx holds it while it decodes a chunk). It decodes what comes down its pipe
    and exits when the pipe closes or its worker dies; it ignores SIGINT and SIGTERM, which
    are its worker's to act on."""

    def __init__(self, decode: Callable[[bytes, str], str], nice: int,
                 prepare: Callable[[], None] | None = None):
        self.conn, child = multiprocessing.Pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the finals process
            code = 0
            try:
                self.conn.close()
                _serve(child, decode, nice, prepare)
            except BaseException:  # noqa: BLE001 - never return into the worker's code
                code = 1
            finally:
                os._exit(code)
        child.close()
        log.info("finals process %d started", self.pid)

    def decode(self, audio: bytes, prompt: str) -> str:
        """The text of one final; EOFError/OSError when the process is gone."""
        self.conn.send((audio, prompt))
        ok, text = self.conn.recv()
        if not ok:
            raise RuntimeError(f"the finals process failed: {text}")
        return text

    def close(self) -> None:
        self.conn.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _serve(conn, decode: Callable[[bytes, str], str], nice: int,
           prepare: Callable[[], None] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # Linux: die with the worker, even in the middle of a final
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        return  # the worker died before the line above
    if nice:
        os.nice(nice)
    if prepare is not None:
        prepare()
    while True:
        try:
            audio, prompt = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, decode(audio, prompt))
        except Exception as exc:  # noqa: BLE001 - the worker decides what a failure ends
            reply = (False, repr(exc))
        conn.send(reply)


class FinalsStage:
    """The finals of one worker process: a thread hands them, in order, to the finals
    process (or, with ``process=False``, decodes them itself) and marks each job done."""

    def __init__(self, decode: Callable[[bytes, str], str], nice: int = 0,
                 process: bool = True, prepare: Callable[[], None] | None = None):
        self._decode = decode
        self._nice = nice
        self._prepare = prepare  # run where the finals are decoded, before the first
        self._process = FinalProcess(decode, nice, prepare) if process else None
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._in_hand = 0
        self._thread = threading.Thread(target=self._run, name="finals", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._idle:
            self._in_hand += 1
        self._jobs.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted final is decoded; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_hand == 0, timeout_s)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        if self._process is None:
            if self._prepare is not None:
                self._prepare()
            if self._nice:
                try:  # Linux: a thread's niceness is its own
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
                except OSError as exc:
                    log.warning("could not lower the finals thread's priority: %s", exc)
        while True:
            job = self._jobs.get()
            if job is None:
                if self._process is not None:
                    self._process.close()
                return
            try:
                self._one(job)
            finally:
                with self._idle:
                    self._in_hand -= 1
                    self._idle.notify_all()

    def _text(self, audio: bytes, prompt: str) -> str:
        """Decode in the finals process; one that died is started again and given the
        same final (a final is lost only if its process dies on it PROCESS_TRIES times)."""
        if self._process is None:
            return self._decode(audio, prompt)
        for _ in range(PROCESS_TRIES):
            try:
                return self._process.decode(audio, prompt)
            except (EOFError, OSError) as exc:
                log.warning("finals process %d is gone (%s); starting another",
                            self._process.pid, exc)
                self._process.close()
                self._process = FinalProcess(self._decode, self._nice, self._prepare)
        raise RuntimeError(f"the finals process died {PROCESS_TRIES} times on one final")

    def _one(self, job: Job) -> None:
        decode_job(job, self._text)

    def sample(self) -> None:
        """A finals stage reports no load (the engine's capacity is fixed)."""
        return None


def decode_job(job: Job, text_of: Callable[[bytes, str], str]) -> None:
    """Decode one final after its session's prompt, and move the prompt on."""
    ctx = job.context
    if ctx.cancelled:
        job.done = True
        return
    try:
        text = text_of(job.audio, ctx.prompt) if job.audio else ""
    except Exception:  # noqa: BLE001 - a decoder bug ends its session, not the worker
        log.exception("decoding a final failed")
        job.failed = True
        text = ""
    job.result = {"text": text}
    ctx.prompt = next_prompt(ctx.prompt, text)
    job.after = {"prompt": ctx.prompt}
    job.done = True


class InlineFinals:
    """No finals stage: each final is decoded when it is handed over, in the caller's
    thread (calibration, benchmarks' direct decodes, a model no worker has started)."""

    def __init__(self, decode: Callable[[bytes, str], str]):
        self._decode = decode

    def submit(self, job: Job) -> None:
        decode_job(job, self._decode)

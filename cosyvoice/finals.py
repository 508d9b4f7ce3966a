"""Whisper finals off the partials' path.

A worker process decodes every owned session's chunks in one loop: PocketSphinx, a few
milliseconds a chunk. A Whisper final costs a few hundred milliseconds to seconds; decoded
inside that loop it held up every other session's partials. Here the loop hands each final
to a finals thread of the same process and goes on; the thread decodes the finals one by one
in the order they were handed over (so a session's finals are decoded in utterance order,
each with the text before it as its prompt), and the loop publishes each one when it is done.

Why a thread of the owning process and not a separate stage fed through Redis: the session's
owner stays the only writer of its results and checkpoint, so the ownership guarantees hold
as they are. A final is published with the checkpoint of its own utterance's end, in utterance
order, after every final before it; a worker killed with finals in hand has stored no
checkpoint past them, so whoever takes the session over decodes them again from the audio,
and none is sent twice. The decoder (torch or CTranslate2) releases the interpreter lock
while it computes, and the thread runs at a lower CPU priority (``finals_nice``), so on a
busy machine the partials get the CPU first. docs/benchmarks.md has the numbers.

Context: each session has a ``Context``, the text of its finals so far (its last
``PROMPT_MAX_CHARS``), given to Whisper as the prompt of its next final. The checkpoint
carries it, so a session taken over decodes with the same context.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("cosyvoice.worker")

# The prompt: the end of the session's previous finals, cut at a word. Whisper reads at most
# 223 prompt tokens; 200 characters are about 45, the last sentence or two.
PROMPT_MAX_CHARS = 200


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
    """A session's context for its finals, shared by the loop and the finals thread."""
    prompt: str = ""
    cancelled: bool = False  # the session is no longer this process's: skip its finals


@dataclass
class Job:
    """One final to decode: its utterance's audio (16 kHz PCM) and the result to fill."""
    context: Context
    result: dict
    audio: bytes
    done: bool = False
    failed: bool = False
    prompt_after: str = ""  # the context once this final is decoded


@dataclass
class Pending:
    """What an audio entry publishes in order: its finals (and ``end``), with the checkpoint
    of that entry. Ready when every final job it holds is done."""
    entry_id: str
    results: list[dict]
    checkpoint: dict | None
    done: bool
    jobs: list[Job] = field(default_factory=list)

    def ready(self) -> bool:
        return all(j.done for j in self.jobs)

    def failed(self) -> bool:
        return any(j.failed for j in self.jobs)

    def final_checkpoint(self) -> dict | None:
        """The stored checkpoint: the entry's, with the context after its last final."""
        if self.checkpoint is None or not self.jobs or self.checkpoint.get("done"):
            return self.checkpoint
        return {**self.checkpoint, "prompt": self.jobs[-1].prompt_after}


class FinalsStage:
    """The finals thread of one worker process."""

    def __init__(self, decode: Callable[[bytes, str], str], nice: int = 0):
        self._decode = decode
        self._nice = nice
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._in_hand = 0
        self.decoded = 0
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
        if self._nice:
            try:  # Linux: a thread's niceness is its own
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as exc:
                log.warning("could not lower the finals thread's priority: %s", exc)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._one(job)
            finally:
                with self._idle:
                    self._in_hand -= 1
                    self._idle.notify_all()

    def _one(self, job: Job) -> None:
        ctx = job.context
        if ctx.cancelled:
            job.done = True
            return
        try:
            text = self._decode(job.audio, ctx.prompt) if job.audio else ""
        except Exception:  # noqa: BLE001 - a decoder bug ends its session, not the worker
            log.exception("decoding a final failed")
            job.failed = True
            text = ""
        job.result["text"] = text
        ctx.prompt = next_prompt(ctx.prompt, text)
        job.prompt_after = ctx.prompt
        self.decoded += 1
        job.done = True

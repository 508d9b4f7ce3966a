"""A session a worker owns: its stream, where it is in its audio, its stages and outbox.

``open_session`` builds one when the worker takes a session's lease: from the session's
checkpoint where a worker decoded it before (the stream's state, the next chunk, the
Opus decoders warmed up again on the audio before it), else from the options its client
opened it with (mode, language, prompt, turn detection, text stages, speaker labels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .. import metrics
from ..asr import Model, Stream, Turn
from ..settings import Settings
from ..store.bus import Announcement, Bus
from ..text import speakers, stages
from ..wire.chunk_pb import AudioChunkProto
from ..wire.codecs import SessionAudio
from ..wire.messages import Checkpoint, TextRule
from ..wire.protocol import parse_stored
from .outbox import Outbox

# Stored chunks per read when a session taken over reads back before its checkpoint
# (codecs.SessionAudio.resumed)
WARMUP_PAGE = 16


@dataclass
class OwnedSession:
    sid: str
    announcement: str
    stream: Stream
    position: str  # id of the last audio entry consumed
    next_seq: int
    # its chunks as PCM: Opus decoded, the current rate (cosyvoice/wire/codecs.py)
    audio: SessionAudio
    # the session's text stages, chosen from its settings (cosyvoice/text/stages.py)
    rules: tuple[TextRule, ...] = ()
    # its results on their way out, in order (cosyvoice/worker/outbox.py)
    outbox: Outbox = field(default_factory=Outbox)
    # what it keeps for speaker labels, where it asked for them (cosyvoice/text/speakers/)
    speakers: speakers.SessionSpeakers | None = None
    ended: bool = False  # ``last`` consumed: nothing more to read, the end is pending
    # its client is gone (the grace period): decoded after the connected sessions' work
    away: bool = False


class LazyEmbedder:
    """The worker's speaker embedder thread, started by the first session that asks for
    labels (``thread`` is None until then)."""

    def __init__(self, inline: bool):
        self.inline = inline
        self.thread: speakers.Embedder | None = None

    def __call__(self) -> speakers.Embedder:
        if self.thread is None:
            self.thread = speakers.Embedder(inline=self.inline)
        return self.thread

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()


def open_session(ann: Announcement, info: dict[str, str], checkpoint: Checkpoint | None,
                 model: Model, settings: Settings, bus: Bus,
                 embedder: Callable[[], speakers.Embedder], away: bool) -> OwnedSession:
    """The session of announcement ``ann`` (its hash ``info``) as this worker decodes it;
    ``embedder()``: the worker's speaker embedder."""
    if checkpoint:
        stream = model.stream(checkpoint.rate, checkpoint.state)
        position, next_seq, rate = checkpoint.id, checkpoint.seq + 1, checkpoint.rate
    else:
        rate = int(info["start_rate"])
        stream = model.stream(rate, mode=info.get("mode") or None,
                              language=info.get("language") or None,
                              prompt=info.get("prompt", ""), turn=Turn.from_options(info))
        position, next_seq = "0-0", 0
    undecodable = metrics.OPUS_UNDECODABLE.inc
    audio = (SessionAudio.resumed(rate, stored_back(bus, ann.sid, checkpoint.id),
                                  checkpoint.seq, undecodable)
             if checkpoint else SessionAudio(rate, undecodable))
    rules = stages.text_rules(info)
    labels = None
    options = speakers.Options.from_session(info)
    if options is not None:
        labels = speakers.SessionSpeakers(options, embedder(),
                                          checkpoint.state if checkpoint else None,
                                          settings.speaker_join)
        rules += (labels.rule,)
    return OwnedSession(ann.sid, ann.msg_id, stream, position, next_seq, audio, rules,
                        Outbox(labels.state if labels else None), labels, away=away)


def stored_back(bus: Bus, sid: str, entry_id: str) -> Iterator[AudioChunkProto]:
    """The session's stored chunks from ``entry_id`` back, newest first."""
    upto = entry_id
    while True:
        page = bus.audio_up_to(sid, upto, WARMUP_PAGE)
        yield from (parse_stored(pb) for _, pb in page)
        if len(page) < WARMUP_PAGE:
            return
        upto = "(" + page[-1][0]  # exclusive: before the oldest one read

"""The messages that cross the service's hops, each typed here with its (de)serialisation.

A result travels engine → worker → Redis (``text:{SID}``) → gateway → client:

- an engine's ``Stream.feed``/``flush`` return ``Decoded`` items: a ``Result`` (a partial
  or a final, decoded now) or a ``Scheduled`` one, a result whose decode the engine handed
  to its deferred stage (the 2-pass finals process, whisper-live's decode scheduler), read
  once its ``job`` is done;
- the session's text stages (cosyvoice/text/stages.py) rewrite each result as it is decoded,
  and its outbox (cosyvoice/worker/outbox.py) releases them in the order the audio produced them;
- the worker publishes ``Published`` messages, a ``Result``, the session's ``End`` or an
  ``ErrorResult``, as compact JSON (``to_json``) in the replay stream and on pub/sub;
- the gateway's relay reads them back (``from_json``) and emits each as the Socket.IO
  event ``to_event`` names: ``text`` (a ``TextEvent``: the result and its stream
  ``id``), ``end`` or ``error`` (docs/protocol.md, "Events"), which clients read as these
  types (cosyvoice/client/).

A session's ``Checkpoint`` is what a worker taking it over starts from: the audio entry it
holds at and the engine's state there (``Stream.checkpoint``), stored in
``session:{SID}`` by the same Lua call that publishes the final it follows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, NotRequired, Protocol, TypedDict


class Word(TypedDict):
    """A final's word: its times (seconds from the session's start) and confidence."""
    word: str
    start: float
    end: float
    conf: float


class Result(TypedDict):
    """A partial or a final: the ``text`` event's payload, less its ``id``.

    ``utterance`` counts from 0 per session; ``seq`` is the last chunk the result covers
    (the worker sets it); finals carry ``words`` (empty where the engine gives none) and
    the ``engine`` that produced them; whisper-live partials carry ``stable``, the leading
    words the decode before agreed on. Every partial and final says its ``language``
    (finals with ``language_prob`` where the language was detected)."""
    type: Literal["partial", "final"]
    text: str
    utterance: int
    start: float
    end: float
    seq: NotRequired[int]
    words: NotRequired[list[Word]]
    stable: NotRequired[str]
    engine: NotRequired[str]
    language: NotRequired[str]  # the language it is in (a code, cosyvoice/wire/languages.py)
    language_prob: NotRequired[float]  # where that language was detected: its probability
    speaker: NotRequired[str]  # sessions with speaker labels: S1, S2, … (also on words)
    voices: NotRequired[list]  # diarize "file": [start, end, vector] per piece


class SpeechStarted(TypedDict):
    """Speech began (sessions that asked: ``auth.speech_events``): ``start`` is when
    (seconds from the session's start); the final of the utterance it opens follows."""
    type: Literal["speech_started"]
    start: float
    seq: NotRequired[int]


class LoadNotice(TypedDict):
    """The session's partials are spaced out (or back to normal): one comes every
    ``partial_interval_ms`` of speech (a worker under load, cosyvoice/asr/cadence.py);
    its finals are not delayed."""
    type: Literal["load"]
    partial_interval_ms: int
    busy: bool  # spaced out (False: back to the service's normal cadence)
    seq: NotRequired[int]


class Finalized(TypedDict):
    """A ``finalize`` chunk was decoded: every result of the audio up to chunk ``seq`` was
    published before this (whether the finalize ended an utterance or found none)."""
    type: Literal["finalized"]
    seq: int


class Relabel(TypedDict):
    """The final of ``utterance`` (and its words) belongs to ``speaker`` after all: a later
    final moved it (sessions with speaker labels, cosyvoice/text/speakers/). Where its pieces
    now belong to different speakers, ``spans`` say whose each is: [start, end, speaker],
    each word the span's that holds its middle."""
    type: Literal["relabel"]
    utterance: int
    speaker: str
    spans: NotRequired[list]
    seq: NotRequired[int]


class End(TypedDict):
    """Every result of the session's ``last`` chunk has been published."""
    type: Literal["end"]
    session: str
    seq: int


class ErrorResult(TypedDict):
    """The session ended with an error the client hears (``internal``: a decoding bug)."""
    type: Literal["error"]
    code: str
    msg: str


Published = Result | SpeechStarted | LoadNotice | Finalized | Relabel | End | ErrorResult


def to_json(message: Published) -> str:
    """A published message as stored in ``text:{SID}`` and sent on pub/sub."""
    return json.dumps(message, separators=(",", ":"))


def from_json(payload: str | bytes) -> Published:
    return json.loads(payload)


class TextEvent(Result):
    """The ``text`` event: a result and its ``id`` in the replay stream (a resuming
    client names the last it received as ``auth.last_result``)."""
    id: str


class EndEvent(TypedDict):
    """The ``end`` event: every result of the session's ``last`` chunk was delivered."""
    session: str
    id: str


class ErrorEvent(TypedDict):
    """The ``error`` event (cosyvoice/wire/errors.py has the codes): ``seq`` names the chunk
    refused, ``expected`` the one to resend from after a ``seq_gap``."""
    code: str
    msg: str
    seq: NotRequired[int]
    expected: NotRequired[int]


def to_event(session: str, result_id: str,
             message: Published) -> tuple[str, TextEvent | EndEvent | ErrorEvent]:
    """The Socket.IO event (name, payload) a published message is emitted as: ``text``
    with the result's stream ``id``, ``end`` with the session and that id, or ``error``
    with its code and message."""
    if message["type"] == "end":
        return "end", EndEvent(session=session, id=result_id)
    if message["type"] == "error":
        return "error", ErrorEvent(code=message["code"], msg=message["msg"])
    if message["type"] in ("speech_started", "load", "finalized", "relabel"):
        marker: Any = {**message, "id": result_id}
        return message["type"], marker
    text: Any = {**message, "id": result_id}
    return "text", text


def result_id_key(result_id: str) -> tuple[int, int]:
    """The order of published messages' ids in ``text:{SID}`` (Redis stream ids, "ms-seq")."""
    ms, _, seq = result_id.partition("-")
    return int(ms), int(seq or 0)


class Deferred(Protocol):
    """A decode handed to a deferred stage and not waited for: a finals-stage job
    (cosyvoice/text/finals.py) or a decode scheduler's job (cosyvoice/asr/scheduler.py).
    Once ``done``, ``result`` holds what it decoded (``text``, and ``words`` and the like
    where it has them) unless it was ``dropped`` (no speech, a partial overtaken) or it
    ``failed``; ``after`` holds what the checkpoint stored with its entry says from then
    on (the session's prompt, its utterance count)."""
    @property
    def done(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    @property
    def dropped(self) -> bool: ...
    @property
    def result(self) -> dict[str, Any]: ...
    @property
    def after(self) -> dict[str, Any]: ...


TextRule = Callable[[Result], Result]


@dataclass
class Scheduled:
    """A result to be, the one kind of deferred result: ``result`` as far as it is known
    (type, utterance, times), and the ``job`` a deferred stage decodes the rest with.
    ``rules`` are the session's text stages still to run on it once decoded
    (cosyvoice/text/stages.py). Published in order, once the job is done."""
    result: Result
    job: Deferred
    rules: tuple[TextRule, ...] = ()

    @property
    def done(self) -> bool:
        return self.job.done

    @property
    def failed(self) -> bool:
        return self.job.failed

    def decoded(self) -> Result | None:
        """The result as decoded (and rewritten by ``rules``), or None where the job was
        dropped."""
        if self.job.dropped:
            return None
        out: Any = {**self.result, **self.job.result}
        for rule in self.rules:
            out = rule(out)
        return out


# (an engine's ``speech_started`` item, a ``SpeechStarted``, travels the results' way as
# a Result-shaped dict: stages and the outbox pass it on as it is, in its order)
Decoded = Result | Scheduled
# What an audio entry hands its session's stages and outbox: results and the ``end``
Outgoing = Result | Scheduled | End


def handed(result: Result, job: Deferred, deferred: bool) -> list[Decoded]:
    """A decode an engine handed over, as its stream returns it: the result to be, with
    its job, when a deferred stage decodes it (even one already done: the outbox keeps them
    all in order); the result as decoded when it was decoded inline (nothing if dropped)."""
    item = Scheduled(result, job)
    if deferred:
        return [item]
    decoded = item.decoded()
    return [] if decoded is None else [decoded]


def kind(item: Decoded | End) -> str:
    """``partial``, ``final`` or ``end``, whether decoded yet or not."""
    return (item.result if isinstance(item, Scheduled) else item)["type"]


def with_seq(item: Decoded, seq: int) -> Decoded:
    """The item with ``seq`` set on its result, unless the engine set one."""
    if isinstance(item, Scheduled):
        return replace(item, result={"seq": seq, **item.result})
    return {"seq": seq, **item}


@dataclass(frozen=True)
class Checkpoint:
    """A session's checkpoint: the audio entry (``id``, chunk ``seq``) its stream's
    ``state`` holds at, or ``done`` once the session is finished (a worker that finds it
    never decodes the session again).

    ``state`` is the engine's (``Stream.checkpoint``: its reset point, sample ``rate``,
    and engine-specific fields such as the session's ``mode`` and ``prompt``), updated by
    each deferred decode's ``after`` once it is done. It is stored flat, as one JSON
    object with ``id`` and ``seq`` beside the state's fields."""
    id: str = ""
    seq: int = -1
    state: dict[str, Any] = field(default_factory=dict)
    done: bool = False

    @classmethod
    def finished(cls) -> Checkpoint:
        return cls(done=True)

    @property
    def rate(self) -> int:
        return int(self.state["rate"])

    @property
    def prompt(self) -> str:
        """Whisper's context for the session's next final."""
        return str(self.state.get("prompt", ""))

    def updated(self, after: dict[str, Any]) -> Checkpoint:
        """The checkpoint once decodes ``after`` it are done (``Deferred.after``)."""
        return replace(self, state={**self.state, **after}) if after else self

    def to_json(self) -> str:
        if self.done:
            return json.dumps({"done": True})
        return json.dumps({**self.state, "id": self.id, "seq": self.seq})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Checkpoint:
        fields = json.loads(raw)
        if fields.get("done"):
            return cls.finished()
        return cls(str(fields.pop("id")), int(fields.pop("seq")), fields)

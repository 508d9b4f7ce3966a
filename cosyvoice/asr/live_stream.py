"""A ``whisper-live`` session's stream (``LiveStream``): the front end (resampler, VAD,
endpointer), its utterances, when to ask the model's runner for a partial or a final, and
what a decode's answer becomes (``_finish_partial``, ``_finish_final``). The engine's rules
are ``live_engine.py``'s docstring."""

from __future__ import annotations

import base64
from typing import Any, Callable, Protocol, cast

from ..settings import Settings
from ..text.finals import next_prompt
from ..wire import messages
from ..wire.languages import ENGLISH
from ..wire.resample import ModelRateInput
from .endpointer import Endpointer, SileroVad, Turn, next_frame
from .scheduler import DecodeJob, DecodeScheduler, Inline, StreamState
from .tiny_whisper import FULL_WINDOW_S, PAD_S, WINDOW_MARGIN_S, Decoded

ENGINE = "whisper-live"
MODEL_RATE = 16000
# Longest clip one decode takes: Whisper's window less the padding and the margin.
MAX_CLIP_S = FULL_WINDOW_S - 2 * PAD_S - WINDOW_MARGIN_S
# A chunk that ends in this many frames of silence (32 ms each) ends a long utterance.
PAUSE_FRAMES = 3
# Shortest open utterance worth a partial.
MIN_PARTIAL_S = 0.5
# A partial of an ``auto`` session not known to be English that is detected as English this
# surely moves it to tiny.en at once (the rest of the utterance, its final included).
EARLY_ENGLISH_PROB = 0.9
# A session is told of a new partial interval (a ``load`` event) when it changes from the
# base to longer or back, or by at least this much
TELL_STEP_S = 0.5


class StreamModel(Protocol):
    """What a stream uses of its model (``live_engine.LiveModel``)."""

    settings: Settings
    runner: Inline | DecodeScheduler
    clock: Callable[[], float]

    def vad_session(self) -> Any: ...


def prompt_in(prompt: str, prompt_language: str, language: str) -> str:
    """The session's finals so far (``prompt``, in ``prompt_language``; "" before any) as
    the prompt of a decode in ``language``: none across a change of language."""
    return prompt if prompt_language in ("", language) else ""


def _norm(word: str) -> str:
    return "".join(c for c in word.lower() if c.isalnum() or c == "'")


def agreed_prefix(a: list[str], b: list[str]) -> int:
    """How many leading words two hypotheses share (case and punctuation aside)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if _norm(x) != _norm(y):
            break
        n += 1
    return n


def _finish_partial(job: DecodeJob, decoded: Decoded) -> None:
    """A partial's text and ``stable`` prefix, or dropped (no text, no change). A partial
    whose language was detected as surely English moves an ``auto`` session to tiny.en."""
    st = job.state
    words = decoded.text.split()
    current = job.utterance == st.utterance  # not overtaken by its own final
    if current and decoded.language_prob is not None:
        st.detected = (job.utterance, decoded.language_prob)
        if decoded.language == ENGLISH and decoded.language_prob >= EARLY_ENGLISH_PROB:
            st.current = ENGLISH
    stable = agreed_prefix(st.hyp, words) if current else 0
    if current:
        st.hyp = words
    if not words or (current and decoded.text == st.last_partial):
        job.dropped = True
        return
    if current:
        st.last_partial = decoded.text
    job.result.update(text=decoded.text, stable=" ".join(words[:stable]),
                      utterance=job.utterance, language=decoded.language)


def _finish_final(job: DecodeJob, decoded: Decoded) -> None:
    """A final's text and words; the session's prompt and utterance count move on."""
    st = job.state
    st.hyp, st.last_partial = [], ""
    r = job.result
    if decoded.text:
        start, end = r["start"], r["end"]
        words = [{**w, "start": min(round(start + w["start"], 3), end),
                  "end": min(round(start + w["end"], 3), end)} for w in decoded.words]
        r.update(text=decoded.text, utterance=st.utterance, words=words,
                 language=decoded.language)
        prob = decoded.language_prob
        if prob is None and st.detected and st.detected[0] == st.utterance:
            prob = st.detected[1]  # detected on this utterance's partial
        if prob is not None:
            r["language_prob"] = prob
        st.prompt = next_prompt(prompt_in(st.prompt, st.prompt_language, decoded.language),
                                decoded.text)
        st.prompt_language = decoded.language
        st.utterance += 1
    else:
        job.dropped = True
    st.detected = None
    job.after = {"prompt": st.prompt, "utterance": st.utterance, "current": st.current,
                 "prompt_language": st.prompt_language}


class LiveStream:
    def __init__(self, model: StreamModel, cp: dict, defer_finals: bool = False,
                 partials: bool = True):
        s = model.settings
        self._model = model
        self._defer_finals = defer_finals  # the 2-pass engine decodes the finals
        # a deferred final's audio, by utterance, until the 2-pass engine takes it
        self._finished_audio: dict[int, bytes] = {}
        self._partials = partials
        self._window = s.endpoint_window_s
        self._ratio = s.endpoint_ratio
        self._preroll = int(s.endpoint_preroll_s * MODEL_RATE)
        self._max_utt = int(min(s.max_utterance_s, MAX_CLIP_S) * MODEL_RATE)
        self._pause_cut = int(s.live_pause_cut_s * MODEL_RATE)
        self._interval = s.live_partial_interval_s
        self._told = self._interval  # the interval the client was last told of (load)
        # A start is called once most of a window is speech: keep a window and more.
        self._history_bytes = 2 * (self._preroll + int((self._window + 0.2) * MODEL_RATE))
        self._offset = int(cp["offset"])  # model-rate samples received since session start
        self._rate = int(cp["rate"])
        lang = str(cp.get("language", ENGLISH))
        self._turn = Turn.from_options(cp)
        self._events: list[messages.Decoded] = []  # speech_started, as the frames go
        self._state = StreamState(prompt=str(cp.get("prompt", "")),
                                  utterance=int(cp["utterance"]), language=lang,
                                  current=str(cp.get("current", lang)),
                                  prompt_language=str(cp.get("prompt_language", "")))
        self._reset_front_end(base64.b64decode(cp.get("preroll", "")))

    @property
    def checkpoint(self) -> dict:
        """The reset point after the last final. With a scheduler, the prompt and the
        utterance count are those of the finals decoded so far: a job's ``after`` gives
        them once its final is done (the worker stores that)."""
        st = self._state
        return {"offset": self._ep_base, "utterance": st.utterance, "rate": self._rate,
                "prompt": st.prompt, "language": st.language, "current": st.current,
                "prompt_language": st.prompt_language, **self._turn.to_checkpoint(),
                "preroll": base64.b64encode(self._carried).decode("ascii")}

    def _reset_front_end(self, carried: bytes = b"") -> None:
        """A fresh front end from here on; ``carried``: the audio just before this point
        that a start's pre-roll may reach back into (the last ``endpoint_preroll_s``)."""
        self._carried = carried[-2 * self._preroll:] if self._preroll else b""
        self._ep = Endpointer(window_s=self._window, ratio=self._ratio, sample_rate=MODEL_RATE,
                              vad=SileroVad(self._model.vad_session()),
                              end_window_s=self._turn.end_window_s)
        self._ep_base = self._offset
        self._buf = bytearray()
        self._ep_pos = 0  # samples the endpointer has seen since the reset
        # the latest audio the stream received, for pre-roll (it ends at ``_ep_pos``)
        self._history = bytearray(self._carried)
        self._input = ModelRateInput(self._rate, MODEL_RATE)
        self._quiet = 0  # frames since the VAD last heard speech
        self._in_utt = False
        self._utt_start = 0
        self._utt_pcm = bytearray()
        self._partial_at = 0  # utterance samples at the last re-decode
        self._partial_time = float("-inf")
        self._speech_at = 0  # endpointer samples when the VAD last heard speech
        self._partial_pos = -1  # ... and at the last re-decode

    def _seconds(self, samples: int) -> float:
        return round(samples / MODEL_RATE, 3)

    # ---- input ------------------------------------------------------------------------

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> list[messages.Decoded]:
        data = self._input.convert(pcm, sample_rate)
        self._rate = self._input.rate
        self._offset += len(data) // 2
        self._buf += data
        end = self._consume_frames()
        events, self._events = self._events, []
        if end is not None:
            return events + self._finish_and_reset(end)
        if not self._in_utt:
            return events
        length = len(self._utt_pcm) // 2
        if length >= self._max_utt or (length >= self._pause_cut
                                       and self._quiet >= PAUSE_FRAMES):
            return events + self._finish_and_reset(self._ep_base + self._ep_pos)
        return events + self._partial()

    def _consume_frames(self) -> int | None:
        """Run whole frames through the endpointer; the end sample at an endpoint."""
        ep = self._ep
        fb = ep.frame_bytes
        while len(self._buf) >= fb:
            frame = next_frame(self._buf, self._history, fb, self._history_bytes)
            self._ep_pos += fb // 2
            was_in_speech = ep.in_speech
            out = ep.process(frame)
            self._quiet = 0 if ep.last_speech else self._quiet + 1
            if ep.last_speech:
                self._speech_at = self._ep_pos
            if out is None:
                continue
            if not was_in_speech:
                self._start_utterance()
            self._utt_pcm += out
            if not ep.in_speech:
                return self._ep_base + int(round(ep.speech_end * MODEL_RATE))
        return None

    def _start_utterance(self) -> None:
        """Open an utterance with the pre-roll: the audio just before the detected start."""
        self._in_utt = True
        start = int(round(self._ep.speech_start * MODEL_RATE))
        hist_start = self._ep_pos - len(self._history) // 2
        pre_from = max(hist_start, start - self._preroll)
        self._utt_start = self._ep_base + pre_from
        self._utt_pcm = bytearray(
            self._history[(pre_from - hist_start) * 2:(start - hist_start) * 2])
        if self._turn.speech_events:
            self._events.append(cast(messages.Result, {
                "type": "speech_started", "start": self._seconds(self._ep_base + start)}))

    # ---- output -----------------------------------------------------------------------

    def _partial(self) -> list[messages.Decoded]:
        if not self._partials:
            return []
        runner = self._model.runner
        runner.speaking(self._state)
        interval = runner.partial_interval or self._interval
        told = self._tell(interval)
        n = len(self._utt_pcm) // 2
        now = self._model.clock()
        if (n < MIN_PARTIAL_S * MODEL_RATE or n - self._partial_at < interval * MODEL_RATE
                or now - self._partial_time < interval):
            return told
        # no speech since the last partial (the VAD called the new audio silence): its
        # decode would say the same
        if self._speech_at <= self._partial_pos:
            return told
        self._partial_at, self._partial_time, self._partial_pos = n, now, self._ep_pos
        result = {"type": "partial", "text": "", "stable": "", "utterance": 0,
                  "start": self._seconds(self._utt_start), "end": self._seconds(self._offset)}
        return told + self._ask(DecodeJob("partial", self._state, bytes(self._utt_pcm),
                                          result, _finish_partial))

    def _tell(self, interval: float) -> list[messages.Decoded]:
        """A ``load`` event where the session's partial interval changed since it was last
        told: from the base to longer or back, or by ``TELL_STEP_S`` or more."""
        base = self._interval
        if interval == self._told or ((interval > base) == (self._told > base)
                                      and abs(interval - self._told) < TELL_STEP_S):
            return []
        self._told = interval
        return [cast(messages.Result, {"type": "load", "busy": interval > base,
                                       "partial_interval_ms": int(round(interval * 1000))})]

    def _ask(self, job: DecodeJob) -> list[messages.Decoded]:
        """Hand a decode to the runner: its result when decoded here and now; otherwise
        the result to be, with its ``job`` (the worker publishes it once done)."""
        runner = self._model.runner
        runner.submit(job)
        return messages.handed(cast(messages.Result, dict(job.result)), job,
                               deferred=isinstance(runner, DecodeScheduler))

    def _finish_and_reset(self, end_sample: int) -> list[messages.Decoded]:
        out = self._finish(end_sample)
        # The rest of the chunk is not run through this endpointer, but the next
        # utterance's pre-roll may reach back into it (its onset may be there).
        self._reset_front_end(bytes(self._history + self._buf))
        return out

    def _finish(self, end_sample: int) -> list[messages.Decoded]:
        """Decode the utterance in progress; its final, if it said anything."""
        self._in_utt = False
        result = {"type": "final", "text": "", "utterance": 0,
                  "start": self._seconds(self._utt_start), "end": self._seconds(end_sample),
                  "words": [], "engine": ENGINE}
        if self._defer_finals:  # every utterance is one, whatever its final says
            st = self._state
            st.hyp, st.last_partial = [], ""
            utterance = st.utterance
            result.update(utterance=utterance)
            st.utterance += 1
            self._finished_audio[utterance] = bytes(self._utt_pcm)
            return [cast(messages.Result, result)]
        return self._ask(DecodeJob("final", self._state, bytes(self._utt_pcm), result,
                                   _finish_final))

    def take_utterance_audio(self, utterance: int) -> bytes:
        """A deferred final's audio (``defer_finals``), as PocketSphinx's stream gives it."""
        return self._finished_audio.pop(utterance, b"")

    def finalize(self) -> list[messages.Decoded]:
        """The utterance in progress ends at the audio received so far (whole frames; the
        rest starts the next one): its final now, the stream goes on."""
        end = self._consume_frames()
        events, self._events = self._events, []
        if end is None and self._in_utt:
            end = self._ep_base + self._ep_pos
        if end is None:
            return events
        return events + self._finish_and_reset(end)

    def flush(self) -> list[messages.Decoded]:
        """End of stream: decode what is buffered and return the last final."""
        tail = self._input.flush()
        self._offset += len(tail) // 2
        self._buf += tail
        end = self._consume_frames()
        events, self._events = self._events, []
        if end is None and self._ep.in_speech:
            tail = self._ep.end_stream(bytes(self._buf)) or b""
            self._utt_pcm += tail
        self._buf.clear()
        if end is None and self._in_utt:
            end = self._offset
        if end is None:
            self._reset_front_end(bytes(self._history))
            return events
        return events + self._finish_and_reset(end)

    def close(self) -> None:
        cancel = getattr(self._model.runner, "cancel", None)
        if cancel is not None:
            cancel(self._state)

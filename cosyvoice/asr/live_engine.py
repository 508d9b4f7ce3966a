"""``whisper-live``: Whisper tiny.en (``tiny_whisper.py``) for partials and finals in
English, a multilingual Whisper (the packaged base, or ``COSYVOICE_MULTILINGUAL_MODEL``) in
every other language.

No true streaming neural model ships its weights in a package here, so this engine does what
WhisperLive and whisper_streaming do: a small Whisper decodes the open utterance again as
speech arrives.

- **Endpointing.** The endpointer (``endpointer.py``, the rule the PocketSphinx engine
  uses) on Silero VAD splits the stream into utterances; audio it calls silence is never
  decoded. Silero rather than PocketSphinx's detector: on the fixtures it found every
  utterance and nothing in noise or tones, where PocketSphinx's found two false ones, for
  0.003 CPU-s per audio second (benchmarks/vad.py, docs/engines.md). A start keeps
  ``endpoint_preroll_s`` of audio before it, so soft onsets survive.
- **Partials.** While an utterance is open it is decoded again (greedy) once at least
  the partial interval of new audio has arrived *and* as long has passed on the
  clock since the last re-decode: a session that is behind (a worker catching up, a
  take-over replaying its audio) skips re-decodes instead of queueing them. The interval
  is ``live_partial_interval_s``, or, with a decode scheduler, the one it sets from its
  load (cosyvoice/asr/cadence.py: under load partials are spaced out, down to one per
  ``live_partial_floor_s``); a session whose interval changes gets a ``load`` event with
  its ``partial_interval_ms`` (once it is longer than the base, and again when it is back).
  No partial is decoded where the VAD heard no speech since the last one; an English
  partial is decoded without the session's prompt (``_decode_partials``). A partial
  carries ``stable``: the words its decode and the one before agree on (LocalAgreement, as
  whisper_streaming), which later partials of the utterance rarely change.
- **Finals** at each endpoint: beam search (``live_beam_size``), the session's previous
  finals as Whisper's prompt, word times and confidences from the cross-attention
  alignment. An utterance is cut before it outgrows Whisper's window: after
  ``live_pause_cut_s`` at the first chunk that ends in a pause (``PAUSE_FRAMES`` frames the
  VAD calls silence), at ``max_utterance_s`` (at most ``MAX_CLIP_S``) regardless.
- **Nothing from no speech**: the VAD first, then Whisper's own no-speech rule and text
  without a letter or digit (Whisper writes "." on silence) give no final.

Decodes go through the model's runner: in the caller's thread (``Inline``: tests, direct
decodes, ``COSYVOICE_DECODE_BATCH=0``), or the worker process's decode scheduler
(``scheduler.py``: finals first, partials coalesced and batched), in which case ``feed``
returns each partial and final undecoded with its ``job`` and the worker publishes it once
done. The session state decodes change (prompt, utterance count, the last partial's words)
lives in a ``StreamState`` that only the runner touches.

- **Languages** (``StreamState.language``, the session's ``auth.language``). ``en``
  decodes with tiny.en alone; another language with the multilingual model in that
  language. ``auto`` detects the language of each utterance on the multilingual model's
  encoder output (one decoder step more) until one is English: from then on tiny.en
  decodes, and the multilingual model is asked again only when tiny.en's final reads as
  a model lost in a language it does not know (average log-probability under
  ``language_recheck_logprob``: English speech gives -0.04 to -0.33, Mandarin -0.86 to
  -1.39). A detection with less than ``SWITCH_PROB`` does not move a session off the
  language it is in. Partials follow the language the session is in (detected on their
  own clip while it is not English); a partial detected as English with at least
  ``EARLY_ENGLISH_PROB`` moves the session to tiny.en at once, so an English speaker pays
  the multilingual model for one partial, not for a whole utterance. Each final says its
  ``language``, with the detection's ``language_prob`` where it was detected on its
  utterance (docs/languages.md).

Checkpoint: after each final the front end (VAD, endpointer, resampler, frame buffer) is
reset at the chunk boundary, as in the PocketSphinx engine; the checkpoint is that reset
point, the prompt, and the last ``endpoint_preroll_s`` of audio before it (the next
utterance's onset may be there: an endpoint is called a window after the speech ended, and
the next speaker may have started by then). Decoding is deterministic (CTranslate2 on one
thread), so a stream rebuilt from a checkpoint gives the same finals as the original from
the next chunk on.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Callable, cast

from ..settings import Settings
from ..text.finals import next_prompt
from ..wire import messages
from ..wire.languages import AUTO, ENGLISH
from ..wire.resample import ModelRateInput
from . import model_data
from .cadence import Cadence
from .endpointer import Endpointer, SileroVad, Turn, next_frame, silero_session
from .scheduler import DecodeJob, DecodeScheduler, Inline, StreamState
from .tiny_whisper import (
    FULL_WINDOW_S,
    PAD_S,
    WINDOW_MARGIN_S,
    Decoded,
    TinyWhisper,
    model_dir,
)

ENGINE = "whisper-live"
MODEL_RATE = 16000
# Longest clip one decode takes: Whisper's window less the padding and the margin.
MAX_CLIP_S = FULL_WINDOW_S - 2 * PAD_S - WINDOW_MARGIN_S
# A chunk that ends in this many frames of silence (32 ms each) ends a long utterance.
PAUSE_FRAMES = 3
# Shortest open utterance worth a partial.
MIN_PARTIAL_S = 0.5
# A detection less sure than this keeps an ``auto`` session in the language it is in.
SWITCH_PROB = 0.5
# A partial of an ``auto`` session not known to be English that is detected as English this
# surely moves it to tiny.en at once (the rest of the utterance, its final included).
EARLY_ENGLISH_PROB = 0.9
MULTILINGUAL = "multilingual"  # the multilingual decoder's name (its clips' owner)
# A session is told of a new partial interval (a ``load`` event) when it changes from the
# base to longer or back, or by at least this much
TELL_STEP_S = 0.5


def prompt_in(prompt: str, prompt_language: str, language: str) -> str:
    """The session's finals so far (``prompt``, in ``prompt_language``; "" before any) as
    the prompt of a decode in ``language``: none across a change of language."""
    return prompt if prompt_language in ("", language) else ""


def multilingual_dir(settings: Settings):
    """The multilingual model's CTranslate2 directory: ``multilingual_model``, else the
    packaged Whisper base (joined and verified once, cosyvoice/asr/model_data.py)."""
    return settings.multilingual_model or model_data.install_ct2()


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


class LiveModel:
    """The decoders of one worker process (tiny.en, the multilingual model): verified
    before the fork, loaded after.

    Decodes run where they are asked for (``Inline``) until ``start_scheduler`` gives the
    process its decode scheduler (cosyvoice/asr/scheduler.py); from then on a stream's
    results come back undecoded, with a ``job`` the worker polls.
    """

    name = ENGINE

    def __init__(self, settings: Settings, decoder: TinyWhisper | None = None,
                 multi: TinyWhisper | None = None):
        self.settings = settings
        self.decoder = decoder or TinyWhisper(model_dir(), threads=settings.whisper_threads,
                                              device=settings.device,
                                              compute_type=settings.compute_type)
        self.multi = multi or TinyWhisper(multilingual_dir(settings), name=MULTILINGUAL,
                                          threads=settings.whisper_threads,
                                          device=settings.device,
                                          compute_type=settings.compute_type)
        self.decoders = {self.decoder.name: self.decoder, self.multi.name: self.multi}
        # The clock partials are paced by (tests may replace it).
        self.clock: Callable[[], float] = time.monotonic
        self._vad_session: Any = None
        self.runner: Inline | DecodeScheduler = Inline(self._decode_final,
                                                       self._decode_partial)

    def preload(self, n: int) -> None:
        pass

    def after_fork(self) -> None:
        """Load what cannot cross a fork (CTranslate2, ONNX Runtime) in this process: tiny.en
        and the VAD before the process takes sessions; the multilingual model where it
        first decodes (the decode scheduler's thread loads it as it starts), so a process
        that replaces a dead one is live as soon as before languages came (the sessions it
        takes over must not lapse to other processes while it loads)."""
        self.decoder.load()
        self.vad_session()

    def _start_decoding(self) -> None:
        self.after_fork()
        self.multi.load()

    def start_scheduler(self, max_batch: int) -> DecodeScheduler:
        """Decode this process's sessions in a scheduler thread from now on."""
        if not isinstance(self.runner, DecodeScheduler):
            s = self.settings
            cadence = Cadence(s.live_partial_interval_s,
                              max(s.live_partial_interval_s, s.live_partial_floor_s),
                              s.live_partial_busy, s.partial_wait_target_ms / 1000)
            self.runner = DecodeScheduler(self._decode_final, self._prepare,
                                          self._decode_partials, max_batch,
                                          start=self._start_decoding, cadence=cadence)
        return self.runner

    def start_stage(self, process: bool = True) -> DecodeScheduler | None:
        """The engine's deferred stage: the decode scheduler, with batches of
        ``decode_batch`` partials (None with ``decode_batch`` 0: every decode inline)."""
        batch = self.settings.decode_batch
        return self.start_scheduler(batch) if batch > 0 else None

    def vad_session(self) -> Any:
        if self._vad_session is None:
            self._vad_session = silero_session()
        return self._vad_session

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None, language: str | None = None,
               prompt: str = "", turn: Turn | None = None) -> "LiveStream":
        lang = language or ENGLISH
        # the caller's prompt is in the session's language (any language, on auto)
        cp = checkpoint or {"offset": 0, "utterance": 0, "rate": sample_rate,
                            "prompt": next_prompt("", prompt),
                            "language": lang, "current": "" if lang == AUTO else lang,
                            "prompt_language": "" if lang == AUTO else lang,
                            **(turn or Turn()).to_checkpoint()}
        return LiveStream(self, cp)

    def first_pass(self, sample_rate: int, checkpoint: dict | None = None,
                   partials: bool = True, turn: Turn | None = None) -> "LiveStream":
        """A stream for the 2-pass engine: its partials (unless ``partials`` is False) and
        its endpoints, but no final decoded here. A final comes back without its text,
        its utterance's audio kept for ``take_utterance_audio``: the 2-pass engine's
        finals stage decodes it after the session's prompt (partials are decoded without
        one)."""
        cp = {**(checkpoint or {"offset": 0, "utterance": 0, "rate": sample_rate,
                                **(turn or Turn()).to_checkpoint()}),
              "prompt": ""}
        return LiveStream(self, cp, defer_finals=True, partials=partials)

    # ---- decodes (where the runner runs them) -----------------------------------------

    def _decode_final(self, job: DecodeJob) -> Decoded:
        """A final in the session's language; an ``auto`` session's language is detected
        (see the module's docstring) and ``state.current`` follows it."""
        st = job.state
        if st.language != AUTO:
            return self._final_in(job, st.language)
        if st.current == ENGLISH:
            out = self._final_in(job, ENGLISH)
            if out.avg_logprob >= self.settings.language_recheck_logprob:
                return out
            clip, encoded = self.multi.encode_clip(job.pcm)
            lang, prob = self.multi.detect(encoded)[0]
            if lang == ENGLISH or prob < SWITCH_PROB:
                out.language_prob = prob if lang == ENGLISH else None
                return out
        else:
            clip, encoded = self.multi.encode_clip(job.pcm)
            lang, prob = self.multi.detect(encoded)[0]
            if st.current and prob < SWITCH_PROB:
                lang = st.current
        st.current = lang
        if lang == ENGLISH:
            out = self._final_in(job, ENGLISH)
        else:
            out = self.multi.transcribe(clip, encoded,
                                        prompt_in(st.prompt, st.prompt_language, lang), lang,
                                        self.settings.live_beam_size, words=True)
        out.language_prob = prob
        return out

    def _final_in(self, job: DecodeJob, language: str) -> Decoded:
        st = job.state
        decoder = self.decoder if language == ENGLISH else self.multi
        return decoder.decode(job.pcm, prompt_in(st.prompt, st.prompt_language, language),
                              beam_size=self.settings.live_beam_size, words=True,
                              language=language)

    def _route(self, st: StreamState) -> tuple[TinyWhisper, str]:
        """The model and language of a partial ("": detected on its own clip, as in an
        ``auto`` session that is not in English, so a change of language shows in the
        partials of the utterance that changes it)."""
        if st.language != AUTO:
            lang = st.language
        else:
            lang = ENGLISH if st.current == ENGLISH else ""
        return (self.decoder, ENGLISH) if lang == ENGLISH else (self.multi, lang)

    def _decode_partial(self, job: DecodeJob) -> Decoded:
        """One partial, decoded here: the scheduler's batch path with a batch of one."""
        job.clip = self._prepare(job)
        return self._decode_partials([job], None)[0]

    def _prepare(self, job: DecodeJob):
        # a shorter encoder window than a final's (live_partial_window_s); a degenerate
        # partial is dropped instead of decoded again (decode_partials)
        decoder, job.language = self._route(job.state)
        return decoder.clip(job.pcm, self.settings.live_partial_window_s)

    def _decode_partials(self, jobs: list[DecodeJob], between) -> list[Decoded]:
        """English partials are decoded without the session's prompt: with it, tiny.en in a
        partial's window gave no text for a third of the sentences and 43 % WER, and took
        a third longer (benchmarks/partial_prompt.py, docs/engines.md "Partials under
        load"); the final that replaces them keeps it."""
        decoder = self.decoders[jobs[0].clip.owner]
        prompts = ["" if j.language == ENGLISH else
                   prompt_in(j.prompt, j.state.prompt_language, j.language) for j in jobs]
        return decoder.decode_partials([j.clip for j in jobs], prompts, between,
                                       [j.language for j in jobs])


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
    def __init__(self, model: LiveModel, cp: dict, defer_finals: bool = False,
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

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

The model (``LiveModel``: the decoders, their runner, the routing of a decode to a
language) is here; a session's stream (``LiveStream``: the front end, utterances, when to
ask for a partial or a final, and what a decode's answer becomes) is ``live_stream.py``'s.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..settings import Settings
from ..text.finals import next_prompt
from ..wire.languages import AUTO, ENGLISH
from . import model_data
from .cadence import Cadence
from .endpointer import Turn, silero_session
from .live_stream import ENGINE, LiveStream, prompt_in
from .scheduler import DecodeJob, DecodeScheduler, Inline, StreamState
from .tiny_whisper import Decoded, TinyWhisper, model_dir

# A detection less sure than this keeps an ``auto`` session in the language it is in.
SWITCH_PROB = 0.5
MULTILINGUAL = "multilingual"  # the multilingual decoder's name (its clips' owner)


def multilingual_dir(settings: Settings):
    """The multilingual model's CTranslate2 directory: ``multilingual_model``, else the
    packaged Whisper base (joined and verified once, cosyvoice/asr/model_data.py)."""
    return settings.multilingual_model or model_data.install_ct2()


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

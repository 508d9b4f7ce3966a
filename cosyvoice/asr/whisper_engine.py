"""2-pass recognition: a first pass for partials and endpoints, Whisper base finals.

The first pass runs the endpointer and the streaming partials: whisper-live's
(``LiveModel.first_pass``: Silero VAD, Whisper tiny.en) or PocketSphinx's
(``COSYVOICE_TWOPASS_PARTIALS``); ``TwoPassStream`` runs either. When it closes an utterance
(endpoint, length cap, or ``last``), the audio of that utterance (pre-roll included) is
decoded again by Whisper base, and that text is the utterance's final, marked
``"engine": "whisper"``. A session chooses
its mode at connect: ``pocketsphinx`` (finals from PocketSphinx), ``2pass`` or
``whisper`` (Whisper finals only, no partials).

Two backends decode the finals, on the same model data (``cosyvoice/asr/model_data.py``):

- ``torch``: openai-whisper's model and greedy decoding, with its own tiktoken
  tokenizer. The checkpoint is loaded with ``torch.load(mmap=True)`` and
  ``load_state_dict(assign=True)`` before the worker processes fork, so every worker
  maps the same file pages, stored in the inference dtype (fp32 on CPU, fp16 on CUDA).
- ``ctranslate2``: faster-whisper with int8 weights, loaded in each finals process
  after the fork (CTranslate2 is not fork-safe), one thread each.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Sequence

import numpy as np

from ..settings import Settings
from ..text import finals
from ..wire.messages import Decoded, Result, handed
from ..wire.registry import ENGINES, WHISPER_BACKENDS
from .endpointer import Turn
from .pocketsphinx_engine import MODEL_RATE, PocketSphinxModel
from .whisper_rules import (  # noqa: F401 - the rules' names, as the 2-pass engine uses them
    COMPRESSION_RATIO_MAX,
    FULL_WINDOW_S,
    MAX_TOKENS_PER_S,
    NO_SPEECH_LOGPROB,
    NO_SPEECH_PROB,
    PAD_S,
    TOKEN_SLACK,
    degenerate,
    limit_threads,
    token_cap,
)

# The encoder window (torch backend): Whisper's encoder reads 30 s of mel whatever the
# utterance's length, and its cost is close to linear in the window. A final is decoded
# with the smallest window that holds the utterance plus WINDOW_MARGIN_S, never below the
# floor (``whisper_window_floor_s``; 0 keeps the full window): windows much shorter than
# Whisper's training make it repeat itself (docs/benchmarks.md, "Encoder window").
WINDOW_SIZES_S = (10, 12, 15, 20, 25, FULL_WINDOW_S)
WINDOW_MARGIN_S = 1.0


def window_s(duration_s: float, floor_s: int) -> int:
    """The encoder window of an utterance of ``duration_s`` (padding included)."""
    if floor_s <= 0:
        return FULL_WINDOW_S
    need = max(floor_s, duration_s + WINDOW_MARGIN_S)
    for size in (floor_s, *WINDOW_SIZES_S):
        if size >= need:
            return min(size, FULL_WINDOW_S)
    return FULL_WINDOW_S


def _float_audio(pcm: bytes) -> np.ndarray:
    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    pad = np.zeros(int(PAD_S * MODEL_RATE), dtype=np.float32)
    return np.concatenate([pad, audio, pad])


class TorchWhisper:
    """openai-whisper on a memory-mapped checkpoint."""

    name = "torch"

    def __init__(self, checkpoint: str, device: str | None = None, threads: int = 1,
                 cpu_bf16: bool = False, window_floor_s: int = 0, int8_decoder: bool = False):
        import torch
        import whisper
        from whisper.model import ModelDimensions, Whisper

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.threads = threads
        # bf16 arithmetic in oneDNN's fp32 matmuls and convolutions, on CPUs that have it
        # (AVX512-BF16, AMX): the weights stay fp32 and shared; each product converts its
        # operands on the fly. 32 % less CPU per 3 s final (docs/benchmarks.md).
        self.cpu_bf16 = (cpu_bf16 and self.device == "cpu"
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if self.device == "cpu":
            torch.set_num_threads(threads)
            self._set_math()
        ckpt = torch.load(checkpoint, map_location="cpu", mmap=self.device == "cpu",
                          weights_only=True)
        dims = ModelDimensions(**ckpt["dims"])
        state = ckpt["model_state_dict"]
        dtype = next(iter(state.values())).dtype
        model = Whisper(dims)
        model.encoder.__class__ = _windowed_encoder_class()
        # assign=True keeps the mapped tensors themselves as the parameters (the freshly
        # initialised ones are freed): no private copy of the weights.
        model.load_state_dict(state, assign=True, strict=True)
        if self.device != "cpu":
            model = model.to(self.device)
        self.model = model.eval()
        self.fp16 = dtype == torch.float16
        self.checkpoint = checkpoint
        self.window_floor_s = window_floor_s
        self.redecodes = 0  # finals decoded again with the full window (degenerate)
        self._whisper = whisper
        self._torch = torch
        # Build the tiktoken encoding now (cached for every decode): openai-whisper reads
        # its vocabulary with an open() it never closes, so do it once, quietly.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            tokenizer = whisper.tokenizer.get_tokenizer(  # called exactly as decode() does
                model.is_multilingual, num_languages=model.num_languages,
                language="en", task="transcribe")
            gc.collect()
        # int8 decoder weights (cosyvoice/asr/int8_decoder.py): a file of their own beside
        # the checkpoint, mapped too (CPU only); a prompt's logits, never read, are skipped.
        self.int8_decoder = int8_decoder and self.device == "cpu"
        if self.int8_decoder:
            from . import int8_decoder as int8
            int8.install(model, int8.load_or_build(model, checkpoint),
                         logit_tail=len(tokenizer.sot_sequence_including_notimestamps))
        self._options = whisper.DecodingOptions(
            task="transcribe", language="en", temperature=0.0, without_timestamps=True,
            fp16=self.fp16)

    def _set_math(self) -> None:
        import torch
        precision = "bf16" if self.cpu_bf16 else "none"
        # torch.backends.mkldnn swaps itself for a module object that has ``matmul`` and
        # ``conv`` at import; torch's type stubs describe the plain module.
        torch.backends.mkldnn.matmul.fp32_precision = precision  # type: ignore[attr-defined]
        torch.backends.mkldnn.conv.fp32_precision = precision  # type: ignore[attr-defined]

    def after_fork(self) -> None:
        if self.device == "cpu":
            self._torch.set_num_threads(self.threads)
            self._set_math()

    def mel(self, audio: np.ndarray, window: int = FULL_WINDOW_S):
        """The log-mel of ``audio`` padded or cut to ``window`` seconds."""
        w = self._whisper
        frames = window * w.audio.FRAMES_PER_SECOND
        mel = w.log_mel_spectrogram(self._torch.from_numpy(audio), self.model.dims.n_mels,
                                    padding=w.audio.N_SAMPLES)
        mel = w.pad_or_trim(mel[:, :frames], frames)
        return mel.to(self.device, self._torch.float16 if self.fp16 else self._torch.float32)

    def decode(self, audios: list[np.ndarray], prompt: str = "") -> list[tuple[str, list[int]]]:
        """Greedy decoding of ≤30 s clips: (text, tokens) each, after the text ``prompt``
        (Whisper's previous-text context; empty for none). Clips of one window size are
        decoded as one batch; a degenerate result in a short window is decoded again with
        the full one."""
        durations = [len(a) / MODEL_RATE for a in audios]
        windows = [window_s(d, self.window_floor_s) for d in durations]
        out: list[tuple[str, list[int]]] = [("", [])] * len(audios)
        for window in sorted(set(windows)):
            batch = [i for i, w in enumerate(windows) if w == window]
            short = window < FULL_WINDOW_S
            cap = token_cap(max(durations[i] for i in batch)) if short else 0
            results = self._decode([audios[i] for i in batch], window, cap, prompt)
            for i, r in zip(batch, results, strict=True):
                if short and degenerate(r.compression_ratio, len(r.tokens), cap):
                    self.redecodes += 1
                    r = self._decode([audios[i]], FULL_WINDOW_S, 0, prompt)[0]
                out[i] = _text_of(r)
        return out

    def _decode(self, audios: list[np.ndarray], window: int, cap: int, prompt: str = "") -> list:
        """openai-whisper's greedy decode in a ``window``-second encoder window, at most
        ``cap`` tokens (0: its default, half the text context), after ``prompt``."""
        torch = self._torch
        options = dataclasses.replace(self._options, sample_len=cap or None,
                                      prompt=prompt or None)
        with torch.inference_mode():
            mels = torch.stack([self.mel(a, window) for a in audios])
            return self._whisper.decode(self.model, mels, options)


def _text_of(result) -> tuple[str, list[int]]:
    silent = (result.no_speech_prob > NO_SPEECH_PROB and result.avg_logprob < NO_SPEECH_LOGPROB)
    return ("" if silent else result.text.strip(), list(result.tokens))


def _windowed_encoder_class():
    """openai-whisper's AudioEncoder, taking any window up to 30 s: the positional
    embedding is cut to the window instead of asserting the full 1500 positions."""
    import torch.nn.functional as F
    from whisper.model import AudioEncoder

    class WindowedAudioEncoder(AudioEncoder):
        def forward(self, x):
            x = F.gelu(self.conv1(x))
            x = F.gelu(self.conv2(x))
            x = x.permute(0, 2, 1)
            positions = self.positional_embedding
            if x.shape[1] > positions.shape[0]:
                raise ValueError(f"an encoder window of {x.shape[1]} positions is over 30 s")
            x = (x + positions[:x.shape[1]]).to(x.dtype)
            for block in self.blocks:
                x = block(x)
            return self.ln_post(x)

    return WindowedAudioEncoder


class CT2Whisper:
    """faster-whisper (CTranslate2), int8 on the CPU; loaded in each worker process."""

    name = "ctranslate2"

    def __init__(self, model_dir: str, compute_type: str = "int8", threads: int = 1,
                 device: str = "cpu"):
        self.model_dir = model_dir
        self.compute_type = compute_type
        self.threads = threads
        self.device = device
        self._model = None

    def after_fork(self) -> None:
        """Nothing yet: the model is loaded by the process that decodes (``load``), the
        worker's finals process, which is forked from the worker after this."""

    def load(self):
        if self._model is None:
            from .device import resolve_compute_type, resolve_device
            limit_threads(self.threads)  # before CTranslate2 is imported
            from faster_whisper import WhisperModel
            self.device = resolve_device(self.device)
            self.compute_type = resolve_compute_type(self.compute_type, self.device)
            self._model = WhisperModel(self.model_dir, device=self.device,
                                       compute_type=self.compute_type,
                                       cpu_threads=self.threads, num_workers=1)
        return self._model

    def decode(self, audios: list[np.ndarray], prompt: str = "") -> list[tuple[str, list[int]]]:
        model = self.load()
        out = []
        for audio in audios:
            segments, _ = model.transcribe(
                audio, language="en", task="transcribe", beam_size=1, temperature=0.0,
                without_timestamps=True, condition_on_previous_text=False,
                vad_filter=False, no_speech_threshold=NO_SPEECH_PROB,
                initial_prompt=prompt or None,
                log_prob_threshold=NO_SPEECH_LOGPROB)
            texts, tokens = [], []
            for seg in segments:
                texts.append(seg.text.strip())
                tokens += list(seg.tokens)
            out.append((" ".join(t for t in texts if t), tokens))
        return out


def load_backend(settings: Settings):
    """The configured final decoder; converts the model data on first use."""
    from . import model_data

    backend = settings.whisper_backend
    if backend not in WHISPER_BACKENDS:
        raise ValueError(f"unknown whisper backend {backend!r}; choose one of {WHISPER_BACKENDS}")
    mdir = settings.model_dir or None
    if backend == "ctranslate2":
        # "auto" is resolved where the model is loaded: importing CTranslate2 here, before
        # the fork, would fix its thread count before limit_threads can
        return CT2Whisper(str(model_data.install_ct2(mdir)), threads=settings.whisper_threads,
                          device=settings.device, compute_type=settings.compute_type)
    device = model_data.resolve_device(settings.device)
    path = model_data.convert(mdir, source=settings.whisper_checkpoint or None, device=device)
    return TorchWhisper(str(path), device=device, threads=settings.whisper_threads,
                        cpu_bf16=settings.whisper_cpu_bf16,
                        window_floor_s=settings.whisper_window_floor_s,
                        int8_decoder=settings.whisper_int8_decoder)


class TwoPassModel:
    """PocketSphinx decoders plus one Whisper final decoder, shared by a worker's sessions.

    Its finals are decoded where ``finals`` runs them: inline (``InlineFinals``: in the
    caller's thread, as calibration and direct decodes do) until ``start_stage`` gives
    the worker process its finals stage (cosyvoice/text/finals.py); from then on a stream's
    finals come back as ``Scheduled``, with a job the outbox waits for.
    """

    def __init__(self, settings: Settings, default_mode: str = "2pass", backend=None):
        self.settings = settings
        self.default_mode = default_mode
        self.name = default_mode
        self.ps = PocketSphinxModel(settings)
        self.backend = backend or load_backend(settings)
        self.finals: finals.InlineFinals | finals.FinalsStage = finals.InlineFinals(
            self.transcribe)
        # COSYVOICE_TWOPASS_PARTIALS=whisper-live: partials and endpoints of the "2pass"
        # and "whisper" modes from whisper-live (docs/engines.md, "2-pass partials"); it
        # loads on its first decode, after the finals process has forked from the worker
        self.live = None
        if settings.twopass_partials == "whisper-live":
            from .live_engine import LiveModel
            self.live = LiveModel(settings)

    def preload(self, n: int) -> None:
        self.ps.preload(n)

    def after_fork(self) -> None:
        self.backend.after_fork()

    def load_finals_decoder(self) -> None:
        """Run by the process that decodes the finals before its first one: loads what
        cannot be shared across a fork (CTranslate2)."""
        load = getattr(self.backend, "load", None)
        if load is not None:
            load()

    def start_stage(self, process: bool = True) -> finals.FinalsStage:
        """This worker process's finals stage: a finals process forked from it now (or,
        ``process=False``, a thread of it), at ``finals_nice``."""
        self.finals = finals.FinalsStage(self.transcribe, self.settings.finals_nice, process,
                                         self.load_finals_decoder)
        return self.finals

    def stream(self, sample_rate: int, checkpoint: dict | None = None,
               mode: str | None = None, language: str | None = None,
               prompt: str = "", turn: Turn | None = None) -> TwoPassStream:
        mode = (checkpoint or {}).get("mode") or mode or self.default_mode
        if mode not in ENGINES["2pass"].modes:
            mode = self.default_mode
        first_cp = None
        if checkpoint is not None:
            first_cp = {k: v for k, v in checkpoint.items() if k != "mode"}
        context = finals.Context(prompt=str(checkpoint.get("prompt", ""))
                                 if checkpoint is not None else finals.next_prompt("", prompt))
        if self.live is not None and mode != "pocketsphinx":
            first = self.live.first_pass(sample_rate, first_cp, partials=mode == "2pass",
                                         turn=turn)
            return TwoPassStream(self, first, mode, sample_rate, context)
        ps_stream = self.ps.stream(sample_rate, first_cp)
        ps_stream.keep_audio = mode != "pocketsphinx"
        return TwoPassStream(self, ps_stream, mode, sample_rate, context)

    def transcribe(self, pcm: bytes, prompt: str = "") -> str:
        """The Whisper final of one utterance (16 kHz PCM), after the text ``prompt``."""
        return self.backend.decode([_float_audio(pcm)], prompt)[0][0]


class TwoPassStream:
    """A 2-pass session: the first pass's stream (whisper-live's, ``LiveModel.first_pass``,
    or PocketSphinx's) gives partials, endpoints and the checkpoint; each final it closes
    goes, with its utterance's audio, to the model's finals (``finals.Job``), decoded
    after the session's prompt (``context``). In ``pocketsphinx`` mode PocketSphinx's own
    finals are the session's."""

    def __init__(self, model: TwoPassModel, first, mode: str, rate: int,
                 context: finals.Context):
        self._model = model
        self._first = first
        self.mode = mode
        self._rate = rate
        self.context = context

    @property
    def checkpoint(self) -> dict:
        return {**self._first.checkpoint, "mode": self.mode}

    def feed(self, pcm: bytes, sample_rate: int | None = None) -> list[Decoded]:
        if sample_rate and sample_rate != self._rate:
            self._rate = sample_rate
            # new audio: Whisper's context starts over (the finals in hand keep theirs)
            self.context = finals.Context()
        return self._second_pass(self._first.feed(pcm, sample_rate))

    def flush(self) -> list[Decoded]:
        return self._second_pass(self._first.flush())

    def finalize(self) -> list[Decoded]:
        return self._second_pass(self._first.finalize())

    def close(self) -> None:
        self.context.cancelled = True  # the finals in hand are skipped
        self._first.close()

    def _second_pass(self, results: Sequence[Decoded]) -> list[Decoded]:
        out: list[Decoded] = []
        for r in results:
            assert isinstance(r, dict), "the first pass decodes its partials itself"
            if self.mode == "pocketsphinx":
                out.append({**r, "engine": "pocketsphinx"} if r["type"] == "final" else r)
            elif r["type"] == "partial":
                if self.mode == "2pass":
                    out.append(r)
            else:
                out += self._final({**r, "text": "", "words": [], "engine": "whisper"},
                                   self._first.take_utterance_audio(r["utterance"]))
        return out

    def _final(self, result: Result, audio: bytes) -> list[Decoded]:
        """Hand a final to the model's finals: decoded now when they run inline,
        otherwise the final to be, with its job."""
        job = finals.Job(self.context, audio)
        runner = self._model.finals
        runner.submit(job)
        return handed(result, job, deferred=isinstance(runner, finals.FinalsStage))

"""The rules every Whisper engine here shares: whisper-live's tiny.en decoder
(cosyvoice/asr/tiny_whisper.py) and the 2-pass engine's base finals
(cosyvoice/asr/whisper_engine.py) both import them from this one place.

They keep a small Whisper honest on short windows (measured on the fixtures,
docs/engines.md and docs/whisper.md): padding around an utterance, Whisper's own
no-speech rule, a token cap per second of audio, and the degenerate-output rule that sends
a decode back to the full 30 s window.
"""

from __future__ import annotations

import os

# Silence added around an utterance before Whisper sees it: the endpointer cuts close to
# the last word, and Whisper drops a final word that runs into the end of its input.
PAD_S = 0.2
# Whisper's own rule for a window with no speech (openai-whisper transcribe()).
NO_SPEECH_PROB = 0.6
NO_SPEECH_LOGPROB = -1.0
# The window Whisper was trained on: its encoder always reads this much mel.
FULL_WINDOW_S = 30
# Safety nets for a short window: a decode may produce at most this many tokens per second
# of audio (plus a few), and one that is degenerate (Whisper's own compression-ratio rule,
# or as many tokens as the cap allows) is decoded again with the full window.
MAX_TOKENS_PER_S = 10.0
TOKEN_SLACK = 10
COMPRESSION_RATIO_MAX = 2.4


def token_cap(duration_s: float) -> int:
    """The most tokens a decode of ``duration_s`` may produce in a short window."""
    return int(MAX_TOKENS_PER_S * duration_s) + TOKEN_SLACK


def degenerate(compression_ratio: float, tokens: int, cap: int) -> bool:
    """A result no speaker produces: text that compresses too well (repetition), or a
    decode that ran to its token cap."""
    return compression_ratio > COMPRESSION_RATIO_MAX or tokens >= cap


def limit_threads(threads: int) -> None:
    """Give the numerical libraries of this process ``threads`` threads each.

    Unlimited, numpy's OpenBLAS (the log-mel's matrix product) and CTranslate2's OpenMP
    runtime (the libgomp in its wheel) each keep one thread per core, and the idle ones
    spin-wait after every call: decoding on one thread cost 0.23 CPU-s per 3 s final
    instead of 0.13, at the same wall time (docs/engines.md). OpenBLAS is limited at once
    (threadpoolctl); libgomp reads OMP_NUM_THREADS when CTranslate2 is first imported, so
    call this before that import.
    """
    from threadpoolctl import threadpool_limits

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    threadpool_limits(limits=threads, user_api="blas")

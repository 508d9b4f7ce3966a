"""The registry of recognition engines: one line per engine, read by every part that
needs to know which engines exist (settings, the gateway's session modes, the page's
config, the worker pools, calibration).

Nothing here imports an engine: ``EngineSpec.factory`` names the model's class as
``"module:Class"`` under ``cosyvoice/asr/``, imported only by the worker that loads it
(``cosyvoice.asr.load_model``). So ``cosyvoice/settings.py`` reads the registry without
importing ``cosyvoice.asr``, and the engines can take a typed ``Settings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .languages import AUTO, ENGLISH, WHISPER_LANGUAGES

# Backends of Whisper base finals (COSYVOICE_WHISPER_BACKEND).
WHISPER_BACKENDS = ("torch", "ctranslate2")


@dataclass(frozen=True)
class EngineSpec:
    """One engine and what it declares: where its model comes from, the session modes it
    offers (auth ``mode``; the first is the default), the sessions a worker process
    decodes at once within the latency targets on the reference host (2 cores, measured:
    docs/engines.md, "Capacity"), the languages a session may ask for (``auth.language``,
    cosyvoice/wire/languages.py; the first is the default), and its deferred stage
    (cosyvoice/text/stages.py), if any:

    - ``"finals"``: the worker's finals process decodes its finals (cosyvoice/text/finals.py);
      the factory is called with the engine's name as its ``default_mode``;
    - ``"scheduler"``: a decode scheduler thread decodes everything
      (cosyvoice/asr/scheduler.py), and the worker's capacity follows what it serves
      (cosyvoice/asr/admission.py).
    """
    name: str
    factory: str  # "module:Class" under cosyvoice/asr/, called with (settings)
    modes: tuple[str, ...]
    capacity: int
    # CPU seconds per audio second of one real-time session on the reference host, as
    # cosyvoice/asr/calibrate.py measures it: another host scales ``capacity`` by it.
    reference_cost: float
    stage: Literal["finals", "scheduler"] | None = None
    # the session languages it offers (auth ``language``; the first is the default)
    languages: tuple[str, ...] = (ENGLISH,)


# whisper-live: Whisper tiny.en for English, a multilingual Whisper for the rest, or each
# utterance's language detected (docs/languages.md)
MULTILINGUAL = (AUTO, *WHISPER_LANGUAGES)

ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("whisper-live", "live_engine:LiveModel", ("whisper-live",), capacity=6,
               reference_cost=0.071, stage="scheduler", languages=MULTILINGUAL),
    EngineSpec("pocketsphinx", "pocketsphinx_engine:PocketSphinxModel", ("pocketsphinx",),
               capacity=6, reference_cost=0.094),
    EngineSpec("2pass", "whisper_engine:TwoPassModel", ("2pass", "pocketsphinx", "whisper"),
               capacity=1, reference_cost=0.184, stage="finals"),
    EngineSpec("whisper", "whisper_engine:TwoPassModel", ("whisper", "2pass", "pocketsphinx"),
               capacity=1, reference_cost=0.184, stage="finals"),
    EngineSpec("null", "null_engine:NullModel", ("null",), capacity=6, reference_cost=0.001),
)}
# Every session mode some engine offers.
SESSION_MODES = tuple(dict.fromkeys(m for spec in ENGINES.values() for m in spec.modes
                                    if m != "null"))

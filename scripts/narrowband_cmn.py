"""Prints the initial cepstral mean used for sessions that start at 8 kHz.

PocketSphinx's live CMN starts from a wideband prior ("40,3,-1,0,..."); on 8 kHz audio
(no energy above 4 kHz) that prior is far off and the first seconds decode badly. This
script estimates the mean of band-limited speech: two speech fixtures are taken through
8 kHz and back, decoded in batch mode, and the decoder's cepstral mean is printed. The
result is NARROWBAND_INITIAL_CMN in cosyvoice/asr/pocketsphinx_engine.py.

    python scripts/narrowband_cmn.py
"""

import wave
from pathlib import Path

import numpy as np
import pocketsphinx
import soxr

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def band_limited(name: str) -> bytes:
    with wave.open(str(FIXTURES / f"{name}.wav"), "rb") as w:
        x = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768
    y = soxr.resample(soxr.resample(x, 16000, 8000), 8000, 16000)
    return (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes()


def main() -> None:
    decoder = pocketsphinx.Decoder(loglevel="FATAL")
    decoder.start_utt()
    decoder.process_raw(band_limited("weather") + band_limited("meeting"), full_utt=True)
    decoder.end_utt()
    print(decoder.get_cmn())


if __name__ == "__main__":
    main()

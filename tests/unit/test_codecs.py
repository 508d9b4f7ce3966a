"""The codecs module: Opus framing checks, encoding and decoding through PyAV's libopus."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice.wire import codecs
from cosyvoice.wire.audio import read_audio

from ..helpers import FIXTURES

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def speech() -> bytes:
    return read_audio(str(FIXTURES / "harvard_long.wav"))[0]


def test_every_packet_is_20_ms_and_chunks_hold_200_ms(speech):
    chunks = codecs.opus_chunks(speech, 24000)
    seconds = len(speech) / 2 / codecs.RATE
    assert len(chunks) == pytest.approx(seconds / 0.2, abs=1)
    for chunk in chunks[:-1]:
        assert [codecs.packet_samples(p) for p in chunk] == [960] * codecs.PACKETS_PER_CHUNK
        assert codecs.packets_ms(chunk) == 200
    assert 0 < codecs.packets_ms(chunks[-1]) < 400


@pytest.mark.parametrize("bitrate", [12000, 16000, 24000, 32000])
def test_the_bitrate_is_close_to_the_target(speech, bitrate):
    chunks = codecs.opus_chunks(speech, bitrate)
    bits = 8 * sum(len(p) for chunk in chunks for p in chunk)
    # variable bitrate: speech with pauses comes in under the target, never far over it
    assert 0.5 * bitrate < bits / (len(speech) / 2 / codecs.RATE) < 1.1 * bitrate


def test_decoding_gives_back_the_speech_in_time(speech):
    chunks = codecs.opus_chunks(speech, 24000)
    decoder = codecs.OpusDecoder()
    pcm = b"".join(decoder.decode(chunk) for chunk in chunks) + decoder.flush()
    original = np.frombuffer(speech, dtype="<i2").astype(np.float64)
    decoded = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    # the end padded to a whole frame and the encoder's look-ahead: under 200 ms more
    assert len(original) <= len(decoded) < len(original) + codecs.RATE // 5
    # the encoder's pre-skip is dropped: the waveform lines up with the original, with
    # no shift (the best of the shifts around it)
    n = len(original) - 800

    def match(shift: int) -> float:
        return float(np.corrcoef(original[400:400 + n],
                                 decoded[400 + shift:400 + shift + n])[0, 1])

    assert max(range(-8, 9), key=match) == 0
    assert match(0) > 0.9
    assert decoder.errors == 0


def test_a_decoder_warmed_up_on_two_seconds_matches_one_that_ran_from_the_start(speech):
    """What a worker taking a session over relies on (``codecs.SessionAudio.resumed``)."""
    packets = [p for chunk in codecs.opus_chunks(speech, 24000) for p in chunk]
    whole = codecs.OpusDecoder()
    before = whole.decode(packets[:500])
    after = whole.decode(packets[500:])
    warm = codecs.OpusDecoder()
    warm.decode(packets[400:500])  # two seconds before, output thrown away
    assert warm.decode(packets[500:]) == after
    cold = codecs.OpusDecoder()
    cold.decode(packets[495:500])  # a tenth of a second is not enough
    assert cold.decode(packets[500:]) != after
    assert before


def test_a_session_taken_over_decodes_on_as_the_lost_worker_would(speech):
    """A session's chunks: PCM, then Opus at two bitrates, then PCM again. A worker that
    took it over at any chunk, from the chunks stored up to its checkpoint, feeds the
    engine the same audio from there on as the worker that read it all; a PCM chunk
    after Opus first gets the stretch's last samples."""
    from cosyvoice.wire.chunk_pb import AudioChunkProto, Codec

    pcm = codecs.split_chunks(speech, 16000)[:40]
    opus = codecs.Encodings(pcm)
    chunks = []
    for seq, piece in enumerate(pcm):
        if 5 <= seq < 35:
            chunks.append(AudioChunkProto(seq=seq, codec=Codec.OPUS,
                                          opus=opus.opus(seq, 24000 if seq < 20 else 16000)))
        else:
            chunks.append(AudioChunkProto(seq=seq, pcm=piece, sample_rate=16000))
    chunks[-1].last = True
    errors: list[int] = []
    whole = codecs.SessionAudio(16000, errors.append)
    fed = [whole.pieces(c) for c in chunks]
    # the chunk after the Opus stretch: the stretch's tail, then its own PCM
    assert [rate for _, rate in fed[35]] == [16000, 16000] and fed[35][0][0]
    for at in (3, 10, 14, 25, 34, 36):
        back = list(reversed(chunks[:at + 1]))
        resumed = codecs.SessionAudio.resumed(16000, back, at, errors.append)
        assert [resumed.pieces(c) for c in chunks[at + 1:]] == fed[at + 1:], at
    assert errors == []


@pytest.mark.parametrize("packet,why", [
    (b"", "empty"),
    (bytes([0x03]), "frame count"),
    (bytes([0x03, 0x00]), "zero frames"),
    (bytes([0x01, 1, 2, 3]), "unequal"),
    (bytes([0x02, 200, 1]), "longer than the packet"),
    (bytes([0x03, 0x3F]) + bytes(126), "over 120 ms"),
    (bytes([0x00]) + bytes(1276), "over 1275 bytes"),
])
def test_malformed_framing_is_refused(packet, why):
    with pytest.raises(ValueError, match=why):
        codecs.packet_samples(packet)


def test_a_packet_libopus_refuses_is_silence_of_its_length(speech):
    decoder = codecs.OpusDecoder()
    good = codecs.opus_chunks(speech, 24000)[5]
    decoder.decode(good[:2])
    # valid framing (code 0, one 20 ms CELT frame) around garbage
    out = decoder.decode([bytes([0xF8]) + bytes(range(255, 100, -1))])
    assert len(out) == pytest.approx(codecs.FRAME_SAMPLES * 2, abs=64)
    assert decoder.decode(good[2:])  # and the stream goes on


@pytest.mark.parametrize("text,bitrate", [("24k", 24000), ("24000", 24000),
                                          ("12.5k", 12500), ("32kbit", 32000)])
def test_bitrates_as_people_write_them(text, bitrate):
    assert codecs.parse_bitrate(text) == bitrate


def test_a_bitrate_that_is_not_one():
    with pytest.raises(ValueError, match="not a bitrate"):
        codecs.parse_bitrate("fast")

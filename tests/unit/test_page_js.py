"""The page's JavaScript outside the browser: its unit tests under Node's test runner,
and its chunk encoding read back by the gateway's own codec."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from cosyvoice.wire.protocol import decode_chunk

from ..helpers import ROOT

NODE = shutil.which("node") or "node"

pytestmark = [pytest.mark.fast, pytest.mark.unit]


def test_node_unit_tests_of_capture_and_session_logic_pass():
    proc = subprocess.run([NODE, "--test", "tests/js/"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout


def test_chunk_encoded_by_the_page_is_what_the_gateway_accepts():
    script = """
        import "./tests/js/page-globals.mjs";
        import { encodeChunk } from "./cosyvoice/static/wire.mjs";
        const pcm = Int16Array.from({ length: 3200 }, (_, i) => (i * 37) % 65536 - 32768);
        const first = encodeChunk({ pcm, seq: 0, sampleRate: 16000, sentMs: 1733150000123 });
        const last = encodeChunk({ pcm: new Int16Array(0), seq: 4294967295, last: true,
                                   sentMs: 2 ** 52 });
        console.log(JSON.stringify([first, last].map((b) => Buffer.from(b).toString("hex"))));
    """
    proc = subprocess.run([NODE, "--input-type=module", "-e", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, last = (bytes.fromhex(h) for h in json.loads(proc.stdout))

    chunk = decode_chunk(first, 16000, 1000)
    expected = [(i * 37) % 65536 - 32768 for i in range(3200)]
    assert chunk.pcm == b"".join(v.to_bytes(2, "little", signed=True) for v in expected)
    assert len(chunk.pcm) == 6400
    assert (chunk.seq, chunk.last, chunk.sample_rate) == (0, False, 16000)
    assert chunk.sent_ms == 1733150000123

    end = decode_chunk(last, 16000, 1000)
    assert (end.pcm, end.seq, end.last, end.sample_rate) == (b"", 2**32 - 1, True, 16000)
    assert end.sent_ms == 2**52


def test_an_opus_chunk_encoded_by_the_page_is_what_the_gateway_accepts():
    """The packets themselves come from the browser's WebCodecs encoder
    (tests/e2e/test_browser.py); here, their envelope."""
    packets = [bytes([0x08]) + bytes([k]) * 30 for k in range(10)]  # ten 20 ms frames
    script = f"""
        import "./tests/js/page-globals.mjs";
        import {{ encodeOpusChunk }} from "./cosyvoice/static/wire.mjs";
        const opus = {json.dumps([list(p) for p in packets])}.map((p) => Uint8Array.from(p));
        const bytes = encodeOpusChunk({{ opus, seq: 7, last: true, bitrate: 32000, sentMs: 5 }});
        console.log(Buffer.from(bytes).toString("hex"));
    """
    proc = subprocess.run([NODE, "--input-type=module", "-e", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    chunk = decode_chunk(bytes.fromhex(proc.stdout.strip()), 8000, 1000)
    assert (chunk.codec, chunk.opus, chunk.bitrate) == ("opus", tuple(packets), 32000)
    assert (chunk.seq, chunk.last, chunk.sent_ms, chunk.audio_ms) == (7, True, 5, 200.0)
    assert (chunk.pcm, chunk.sample_rate) == (b"", 16000)


def test_the_pages_subtitles_are_the_command_lines():
    """The page's downloads (subtitles.mjs) and `cosyvoice transcribe --output-format`
    (cosyvoice/text/subtitles.py) cut the same cues from the same finals."""
    from cosyvoice.text import subtitles

    long = " ".join(f"word{k}" for k in range(40))
    finals = [
        {"text": "Glue the sheet to the dark blue background today.", "start": 0.0,
         "end": 2.4, "words": [{"word": w, "start": 0.2 * k + 0.0005, "end": 0.2 * k + 0.15,
                                "conf": 0.9} for k, w in enumerate(
                                    "Glue the sheet to the dark blue background today.".split())]},
        {"text": "", "start": 2.5, "end": 2.6, "words": []},
        {"text": long, "start": 2.0, "end": 21.3, "words": []},
        {"text": "An hour later, the second one.", "start": 3725.123, "end": 3727.9,
         "words": []},
        # Mandarin: words a character or two each, joined without spaces, 16 to a line;
        # then a formatted final whose words no longer spell it: its characters are
        {"text": "北京是中国的首都，今天天气很好，我们去公园散步吧，请问火车站怎么走？",
         "start": 3730.0, "end": 3736.0, "language": "zh",
         "words": [{"word": w, "start": 3730.0 + 0.2 * k, "end": 3730.15 + 0.2 * k,
                    "conf": 0.9} for k, w in enumerate(
                        ["北京", "是", "中国", "的", "首都，", "今天", "天气", "很好，", "我们",
                         "去", "公园", "散步", "吧，", "请问", "火车站", "怎么", "走？"])]},
        {"text": "这件衣服一共¥350。", "start": 3737.0, "end": 3739.0, "language": "zh",
         "words": [{"word": w, "start": 3737.0 + 0.2 * k, "end": 3737.15 + 0.2 * k,
                    "conf": 0.9} for k, w in enumerate(["这件", "衣服", "一共", "三百五十元。"])]},
    ]
    # speaker labels: a final whose words change speaker, then one of another speaker
    labelled = [
        {"text": "hello there how are you", "start": 4000.0, "end": 4002.5, "speaker": "S1",
         "words": [{"word": w, "start": 4000.0 + 0.5 * k, "end": 4000.4 + 0.5 * k,
                    "conf": 0.9, "speaker": "S1" if k < 2 else "S2"}
                   for k, w in enumerate("hello there how are you".split())]},
        {"text": "fine thanks", "start": 4003.0, "end": 4004.0, "speaker": "S2", "words": []},
        {"text": "good", "start": 4005.0, "end": 4005.5, "speaker": "S1", "words": []},
    ]
    finals += labelled
    script = """
        import { toSrt, toText, toVtt } from "./cosyvoice/static/subtitles.mjs";
        const finals = JSON.parse(process.argv[1]);
        console.log(JSON.stringify([toText(finals), toSrt(finals), toVtt(finals)]));
    """
    proc = subprocess.run([NODE, "--input-type=module", "-e", script, json.dumps(finals)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text, srt, vtt = json.loads(proc.stdout)
    assert text == subtitles.to_text(finals)
    assert srt == subtitles.to_srt(finals) and "01:02:05,123 --> " in srt
    assert vtt == subtitles.to_vtt(finals)
    cjk = [c for c in subtitles.cues(finals) if 3730000 <= c.start_ms < 4000000]
    assert all(len(line) <= subtitles.UNSPACED_LINE_CHARS for c in cjk for line in c.lines)
    assert "".join("".join(c.lines) for c in cjk) == "".join(str(f["text"]) for f in finals[4:6])
    assert vtt.startswith("WEBVTT\nLanguage: zh\n\n")
    assert [c.speaker for c in subtitles.cues(labelled)] == ["S1", "S2", "S2", "S1"]
    assert "[S1] hello there\n" in srt and "<v S2>how are you\n" in vtt
    assert text.endswith("\nS1: hello there how are you\n\nS2: fine thanks\n\nS1: good\n")

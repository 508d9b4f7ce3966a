"""Bad input to every command: one clear line on stderr and the documented exit status.

The statuses are ``cosyvoice.cli.EXIT_*`` (docs/cli.md, "Exit status"); each case runs the
real command in a subprocess, against real services where it needs one.
"""

from __future__ import annotations

import http.server
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import soxr

from cosyvoice import cli
from cosyvoice.gateway import tokens
from cosyvoice.store.embedded_redis import free_port
from cosyvoice.wire.audio import read_audio

from .. import launcher
from ..helpers import FIXTURES, ROOT, read_pcm, wer

pytestmark = pytest.mark.system

WEATHER = FIXTURES / "weather.wav"
SECRET = "cli-test-secret"


def run(*args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "cosyvoice", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def assert_fails(proc: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """The command exited with ``status`` and said why in its last stderr line."""
    assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, line
    return line


def write_wav(path: Path, samples: np.ndarray, rate: int, width: int = 2) -> Path:
    """Integer PCM WAV of ``width`` bytes from float samples (frames x channels)."""
    x = np.clip(samples, -1, 1 - 2.0 ** -23)
    if width == 3:
        wide = (x * 2 ** 31).astype("<i4").view(np.uint8).reshape(*x.shape, 4)
        raw = wide[..., 1:].tobytes()
    else:
        raw = (x * 2 ** (8 * width - 1)).astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1 if x.ndim == 1 else x.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return path


# ---- input files --------------------------------------------------------------------------


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    text = tmp / "notes.txt"
    text.write_text("these are meeting notes, not audio\n" * 20)
    truncated = tmp / "truncated.wav"
    truncated.write_bytes(WEATHER.read_bytes()[:30])
    empty = write_wav(tmp / "empty.wav", np.zeros(0, np.float32), 16000)
    return {
        "missing": (tmp / "missing.wav", "no such file"),
        "directory": (tmp, "it is a directory"),
        "text": (text, "is not an audio file"),
        "truncated": (truncated, "is not an audio file"),
        "empty": (empty, "holds no audio"),
    }


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["missing", "directory", "text", "truncated", "empty"])
def test_unreadable_input_file_exits_3(tmp_path, kind):
    path, words = _bad_files(tmp_path)[kind]
    # the file is read before any connection: no service is needed to refuse it
    proc = run("transcribe", str(path), "--url", f"http://127.0.0.1:{free_port()}")
    assert_fails(proc, cli.EXIT_INPUT, "cosyvoice transcribe:", words)


def encode(path: Path, container: str, codec: str, x: np.ndarray, rate: int,
           channels: int) -> Path:
    """16 kHz float samples ``x`` resampled to ``rate``, as ``channels`` channels (the
    second at half level), encoded with PyAV: the library the command decodes with."""
    import av

    y = soxr.resample(x, 16000, rate) if rate != 16000 else x
    y = np.stack([y, y * 0.5], axis=1) if channels == 2 else y[:, None]
    s16 = np.clip(np.round(y * 32767), -32768, 32767).astype("<i2")
    layout = "stereo" if channels == 2 else "mono"
    with av.open(str(path), "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(s16.reshape(1, -1), format="s16", layout=layout)
        frame.rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return path


# (file name, container, codec, rate, channels)
FORMATS = [
    ("s24.wav", "wav", "pcm_s24le", 16000, 1),
    ("stereo44.wav", "wav", "pcm_s16le", 44100, 2),
    ("float22.wav", "wav", "pcm_f32le", 22050, 2),
    ("alaw8.wav", "wav", "pcm_alaw", 8000, 1),
    ("speech.flac", "flac", "flac", 44100, 2),
    ("speech.mp3", "mp3", "libmp3lame", 44100, 2),
    ("speech.ogg", "ogg", "libopus", 48000, 1),
    ("speech.m4a", "ipod", "aac", 44100, 2),
    ("speech.webm", "webm", "libopus", 48000, 2),
]


def transcript_text(proc: subprocess.CompletedProcess) -> str:
    """The transcript ``transcribe`` prints when its output is piped: a final a line."""
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())


def test_audio_files_of_every_common_format_are_transcribed(service, tmp_path):
    """WAV of other layouts, FLAC, MP3, Ogg/Opus, M4A/AAC and WebM, made from a fixture by
    the test: each transcribed within a point of the fixture's own WER, from a file and
    (the first) from standard input."""
    name = "two_utterances"
    x = np.frombuffer(read_pcm(name), "<i2").astype(np.float32) / 32768
    reference = (FIXTURES / f"{name}.txt").read_text().split("\t", 1)[1]
    baseline = wer(reference, transcript_text(run("transcribe", str(FIXTURES / f"{name}.wav"),
                                                  "--url", service.url, "--pace", "fast")))
    for file_name, container, codec, rate, channels in FORMATS:
        path = encode(tmp_path / file_name, container, codec, x, rate, channels)
        pcm, out_rate = read_audio(path)
        assert out_rate == 16000 and abs(len(pcm) / 32000 - len(x) / 16000) < 0.1, file_name
        text = transcript_text(run("transcribe", str(path), "--url", service.url,
                                   "--pace", "fast"))
        assert wer(reference, text) <= baseline + 0.01, (file_name, text)
    with open(tmp_path / FORMATS[-1][0], "rb") as stdin:
        piped = subprocess.run([sys.executable, "-m", "cosyvoice", "transcribe", "-", "--url",
                                service.url, "--pace", "fast"], stdin=stdin,
                               capture_output=True, text=True, timeout=90)
    assert wer(reference, transcript_text(piped)) <= baseline + 0.01


# ---- transcripts as files -----------------------------------------------------------------


def _cue_times_ok(cues: list[tuple[float, float]]) -> None:
    """Each cue has a positive length, starts no earlier than the one before it ends."""
    for k, (start, end) in enumerate(cues):
        assert end > start, cues[k]
        if k:
            assert start >= cues[k - 1][1], (cues[k - 1], cues[k])


def test_transcripts_as_text_json_srt_and_vtt(service, tmp_path):
    """One 21 s recording written in each format: the SRT and WebVTT files parse with
    maintained parsers, in order without overlap, in readable lines, and every format
    carries the same words as the JSON's finals."""
    import srt
    import webvtt

    wav = str(FIXTURES / "harvard_long.wav")
    files = {fmt: tmp_path / f"out.{ext}" for fmt, ext in
             (("json", "json"), ("srt", "srt"), ("vtt", "vtt"), ("text", "txt"))}
    for fmt, path in files.items():
        # the format from the extension for two, from --output-format for the others
        extra = ["--output-format", fmt] if fmt in ("json", "vtt") else []
        proc = run("transcribe", wav, "--url", service.url, "--pace", "fast",
                   "--output", str(path), *extra)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "", "the transcript goes to the file alone"
    doc = json.loads(files["json"].read_text())
    finals = doc["finals"]
    assert len(finals) >= 5
    for f in finals:
        assert f["engine"] and f["text"] and f["end"] > f["start"]
        assert f["words"] and all({"word", "start", "end", "conf"} <= set(w) for w in f["words"])
    words = " ".join(f["text"] for f in finals).split()
    assert doc["text"].split() == words
    reference = (FIXTURES / "harvard_long.txt").read_text().split("\t", 1)[1]
    assert wer(reference, doc["text"]) < 0.15
    assert files["text"].read_text().split() == words
    assert files["text"].read_text().splitlines() == [f["text"].strip() for f in finals]

    subs = list(srt.parse(files["srt"].read_text()))
    assert [s.index for s in subs] == list(range(1, len(subs) + 1))
    _cue_times_ok([(s.start.total_seconds(), s.end.total_seconds()) for s in subs])
    vtt = webvtt.from_string(files["vtt"].read_text()).captions
    _cue_times_ok([(_secs(c.start), _secs(c.end)) for c in vtt])
    for cues in ([s.content for s in subs], [c.text for c in vtt]):
        assert " ".join(cues).split() == words
        for text in cues:
            lines = text.splitlines()
            assert 1 <= len(lines) <= 2 and all(len(line) <= 42 for line in lines), text
    assert len(subs) == len(vtt)
    # the cues follow the speech: the first starts near the first word, the last ends
    # near the last one
    assert abs(subs[0].start.total_seconds() - finals[0]["words"][0]["start"]) < 0.01
    assert subs[-1].end.total_seconds() >= finals[-1]["words"][-1]["end"] - 0.01


def _secs(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


# ---- command line and settings -------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("args,env,words", [
    (["transcribe", str(WEATHER), "--url", "notaurl"], {}, "--url"),
    (["transcribe", str(WEATHER), "--url", "ftp://host/x"], {}, "http:// or https://"),
    (["transcribe", str(WEATHER), "--url", "http://host:99999"], {}, "not a URL"),
    (["transcribe", str(WEATHER), "--timeout", "0"], {}, "--timeout"),
    (["transcribe", str(WEATHER), "--output-format", "docx"], {}, "--output-format"),
    (["transcribe", str(WEATHER), "--json", "--output-format", "srt"], {}, "--output"),
    (["serve"], {"COSYVOICE_PORT": "abc"}, "COSYVOICE_PORT='abc': expected a whole number"),
    (["serve", "--engine", "nope"], {}, "COSYVOICE_ENGINE='nope': expected one of"),
    (["gateway"], {"COSYVOICE_REDIS_URL": "localhost:6379"}, "COSYVOICE_REDIS_URL"),
    (["worker", "--redis-url", "foo://x"], {}, "COSYVOICE_REDIS_URL='foo://x'"),
    (["worker"], {"COSYVOICE_REDIS_URL": "redis://127.0.0.1:1",
                  "COSYVOICE_LEASE_RENEW_MS": "9000"}, "must be less than"),
    (["gateway"], {"COSYVOICE_LOG_LEVEL": "LOUD"}, "COSYVOICE_LOG_LEVEL"),
    (["token"], {"COSYVOICE_AUTH_SECRET": ""}, "COSYVOICE_AUTH_SECRET"),
    (["model", "--from", "/nonexistent/base.pt"], {}, None),
])
def test_bad_command_line_or_setting(args, env, words):
    proc = run(*args, env=env)
    status = cli.EXIT_INPUT if args[0] == "model" else cli.EXIT_USAGE
    line = assert_fails(proc, status, f"cosyvoice {args[0]}")
    assert words is None or words in line
    if args[0] == "model":
        assert "cannot read /nonexistent/base.pt" in line


@pytest.mark.fast
def test_model_from_a_file_that_is_not_a_checkpoint_exits_3(tmp_path):
    notes = tmp_path / "base.pt"
    notes.write_text("not a checkpoint\n")
    proc = run("model", "--from", str(notes), env={"COSYVOICE_MODEL_DIR": str(tmp_path / "m")})
    assert_fails(proc, cli.EXIT_INPUT, f"{notes} is not an openai-whisper checkpoint")


@pytest.mark.fast
def test_gunicorn_config_rejects_a_bad_setting_in_one_line():
    import os
    proc = subprocess.run([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py",
                           "cosyvoice.webui:app"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "COSYVOICE_WORKER_CAPACITY": "-1"})
    assert_fails(proc, cli.EXIT_USAGE, "COSYVOICE_WORKER_CAPACITY=-1")


# ---- unreachable -------------------------------------------------------------------------


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the standard library's name)
        self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture
def web_server():
    """A plain HTTP server that is not cosyvoice."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def tls_server(tmp_path):
    """An HTTPS server with a self-signed certificate no client trusts."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.fast
def test_nothing_listening_exits_4():
    proc = run("transcribe", str(WEATHER), "--url", f"http://127.0.0.1:{free_port()}")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "connection refused")


@pytest.mark.fast
def test_unknown_host_exits_4():
    proc = run("transcribe", str(WEATHER), "--url", "http://no-such-host.invalid:5000")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "cannot resolve", "no-such-host.invalid")


@pytest.mark.fast
def test_a_server_that_is_not_cosyvoice_exits_4(web_server):
    proc = run("transcribe", str(WEATHER), "--url", f"http://{web_server}")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "not a cosyvoice service")
    proc = run("transcribe", str(WEATHER), "--url", f"https://{web_server}")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "TLS", "does it serve https?")


@pytest.mark.fast
def test_an_untrusted_certificate_exits_4(tls_server):
    proc = run("transcribe", str(WEATHER), "--url", f"https://{tls_server}")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "certificate", "not trusted", "--insecure")
    # with --insecure the TLS check passes and the next problem is named instead
    proc = run("transcribe", str(WEATHER), "--url", f"https://{tls_server}", "--insecure")
    assert_fails(proc, cli.EXIT_UNREACHABLE, "not a cosyvoice service")


# ---- refused -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workerless_gateway(module_redis, artifacts):
    """A gateway with token auth and no worker: a signed client is refused as overloaded."""
    env = {"COSYVOICE_AUTH_SECRET": SECRET, "COSYVOICE_OVERLOAD_RETRY_MS": "50"}
    gateway = launcher.start_gateway(module_redis.url, env=env, logs=artifacts,
                                     name="cli-gateway")
    yield gateway.url, gateway.port
    launcher.stop(gateway.proc)


def test_refusals_exit_5(workerless_gateway, service):
    url, _port = workerless_gateway
    proc = run("transcribe", str(WEATHER), "--url", url)
    assert_fails(proc, cli.EXIT_REFUSED, "refused the session", "unauthorized")
    proc = run("transcribe", str(WEATHER), "--url", url, "--token", tokens.issue(SECRET))
    assert_fails(proc, cli.EXIT_REFUSED, "overloaded", "6 attempts")
    assert proc.stderr.count("the service is overloaded; trying again in 50 ms") == 5
    proc = run("transcribe", str(WEATHER), "--url", service.url, "--mode", "whisper")
    assert_fails(proc, cli.EXIT_REFUSED, "unsupported_mode")


def test_gateway_port_in_use_exits_1(workerless_gateway, module_redis):
    _url, port = workerless_gateway
    proc = run("gateway", env={"COSYVOICE_REDIS_URL": module_redis.url,
                               "COSYVOICE_PORT": str(port)})
    assert_fails(proc, cli.EXIT_FAILED, f"cannot listen on 127.0.0.1:{port}", "in use")


# ---- failed and interrupted ----------------------------------------------------------------


def test_no_end_within_the_timeout_exits_1(service):
    proc = run("transcribe", str(WEATHER), "--url", service.url, "--pace", "fast",
               "--timeout", "0.01")
    assert_fails(proc, cli.EXIT_FAILED, "no end of the stream within 0.01 s")


def test_ctrl_c_exits_130_without_a_traceback(service):
    import os
    proc = subprocess.Popen([sys.executable, "-m", "cosyvoice", "transcribe",
                             str(FIXTURES / "harvard_long.wav"), "--url", service.url, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=os.environ.copy())
    assert proc.stdout is not None
    assert '"event": "session"' in proc.stdout.readline()
    time.sleep(1.0)  # streaming now
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert_fails(subprocess.CompletedProcess(proc.args, proc.returncode, "", err),
                 cli.EXIT_INTERRUPTED, "cosyvoice transcribe: interrupted")

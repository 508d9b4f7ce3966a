"""Bad input to every command: one clear line on stderr and the documented exit status.

The statuses are ``cosyvoice.cli.EXIT_*`` (README, "Exit status"); each case runs the
real command in a subprocess, against real services where it needs one.
"""

from __future__ import annotations

import http.server
import signal
import ssl
import struct
import subprocess
import sys
import threading
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import soxr

from cosyvoice import cli, tokens
from cosyvoice.audio import read_wav
from cosyvoice.embedded_redis import free_port

from . import launcher
from .helpers import FIXTURES, ROOT, direct_decode, fixture_texts, read_pcm, wer

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


def float_wav(path: Path) -> Path:
    """A 32-bit float WAV (format 3), which the standard wave module cannot read."""
    data = np.zeros(1600, np.float32).tobytes()
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + \
        struct.pack("<IHHIIHH", 16, 3, 1, 16000, 64000, 4, 32) + b"data" + \
        struct.pack("<I", len(data))
    path.write_bytes(header + data)
    return path


def weather_samples() -> np.ndarray:
    return np.frombuffer(read_pcm("weather"), "<i2").astype(np.float32) / 32768


# ---- input files --------------------------------------------------------------------------


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    text = tmp / "notes.txt"
    text.write_text("these are meeting notes, not audio\n" * 20)
    truncated = tmp / "truncated.wav"
    truncated.write_bytes(WEATHER.read_bytes()[:30])
    empty = write_wav(tmp / "empty.wav", np.zeros(0, np.float32), 16000)
    return {
        "missing": (tmp / "missing.wav", "No such file"),
        "directory": (tmp, "Is a directory"),
        "text": (text, "not a WAV file"),
        "truncated": (truncated, "ends inside its header"),
        "float": (float_wav(tmp / "float.wav"), "32-bit float WAV is not supported"),
        "empty": (empty, "holds no audio"),
    }


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["missing", "directory", "text", "truncated", "float", "empty"])
def test_unreadable_input_file_exits_3(tmp_path, kind):
    path, words = _bad_files(tmp_path)[kind]
    # the file is read before any connection: no service is needed to refuse it
    proc = run("transcribe", str(path), "--url", f"http://127.0.0.1:{free_port()}")
    assert_fails(proc, cli.EXIT_INPUT, "cosyvoice transcribe:", words)


def test_wav_layouts_are_converted_and_transcribed(service, tmp_path):
    """24-bit, stereo at 44.1 kHz and 8-bit WAV: read, converted to what the service
    takes, and transcribed as well as the recogniser does on the converted audio."""
    x = weather_samples()
    stereo44 = soxr.resample(x, 16000, 44100)
    files = {
        "24-bit": write_wav(tmp_path / "w24.wav", x, 16000, width=3),
        "stereo 44.1 kHz": write_wav(tmp_path / "w44.wav",
                                     np.stack([stereo44, stereo44 * 0.5], axis=1), 44100),
        "32-bit": write_wav(tmp_path / "w32.wav", x, 16000, width=4),
    }
    reference = fixture_texts()["weather"]
    for name, path in files.items():
        pcm, rate = read_wav(path)
        assert rate == 16000, name
        converted = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        if name != "stereo 44.1 kHz":  # the same samples, to the last bit of 16
            assert np.abs(converted - x).max() <= 1 / 32768, name
        proc = run("transcribe", str(path), "--url", service.url, "--pace", "fast")
        assert proc.returncode == 0, (name, proc.stderr)
        text = " ".join(line.split("] ", 1)[1] for line in proc.stdout.splitlines()
                        if line.startswith("["))
        assert wer(reference, text) <= wer(reference, direct_decode(pcm)) + 0.01, (name, text)


# ---- command line and settings -------------------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("args,env,words", [
    (["transcribe", str(WEATHER), "--url", "notaurl"], {}, "--url"),
    (["transcribe", str(WEATHER), "--url", "ftp://host/x"], {}, "http:// or https://"),
    (["transcribe", str(WEATHER), "--url", "http://host:99999"], {}, "not a URL"),
    (["transcribe", str(WEATHER), "--timeout", "0"], {}, "--timeout"),
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

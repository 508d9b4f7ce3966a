"""`cosyvoice serve`: the one-command laptop service, and a clean Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cosyvoice.client import transcribe_pcm
from cosyvoice.store.embedded_redis import free_port

from ..helpers import ROOT, direct_decode, fixture_texts, read_pcm, wer
from ..launcher import wait_for, wait_http

pytestmark = pytest.mark.e2e


def test_serve_runs_everything_and_ctrl_c_leaves_nothing_behind(artifacts):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COSYVOICE_")}
    with open(artifacts / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cosyvoice", "serve", "--port", str(port),
                                 "--workers", "2"], env=env, cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", proc, timeout=60)

        def everything():
            # the worker pool starts once the gateway answers (docs/deployment.md)
            found = psutil.Process(proc.pid).children(recursive=True)
            names = " ".join(" ".join(p.cmdline()) for p in found)
            if "redis-server" in names and "gateway" in names and "worker" in names:
                return found
            return None

        descendants = wait_for(everything, timeout=10)
        # the gateway answers before the workers have loaded; the session waits for them
        result = transcribe_pcm(url, read_pcm("meeting"), 16000, pace="fast")
        ref = fixture_texts()["meeting"]
        assert wer(ref, result.text) <= wer(ref, direct_decode(read_pcm("meeting"))) + 0.01
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        time.sleep(0.2)
        left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

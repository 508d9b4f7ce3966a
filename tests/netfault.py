"""A TCP proxy whose connections the test can cut, like a phone changing networks."""

from __future__ import annotations

import socket
import threading

from cosyvoice.store.embedded_redis import free_port


class CuttableProxy:
    """``listen_host``: the address it listens on (the host's end of a test's own link)."""

    def __init__(self, upstream_port: int, listen_host: str = "127.0.0.1"):
        self.upstream_port = upstream_port
        self.host = listen_host
        self.port = free_port()
        self._server = socket.create_server((listen_host, self.port))
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            self._bridge(client, upstream)

    def _bridge(self, client: socket.socket, upstream: socket.socket) -> None:
        """Carry each direction of a new connection (a subclass may delay it)."""
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Drop every open connection at once (new ones are still accepted)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already shut down by its pump: it must still be closed
            s.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.cut()

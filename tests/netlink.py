"""A slow link of the test's own: a network namespace joined to the host by a veth pair,
the namespace's end shaped with ``tc tbf`` (its uplink: what a client there sends).

Only the pair this creates is shaped, never ``lo`` or the host's own interfaces, and the
namespace (with both ends of the pair) is removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .launcher import scaled


@dataclass(frozen=True)
class Link:
    namespace: str
    host_ip: str  # the host's end, where a server for the namespace listens
    client_ip: str
    device: str  # the namespace's end of the pair, whose egress is shaped
    burst: str
    limit: str

    def set_rate(self, rate_kbit: int) -> None:
        """Shape the uplink to ``rate_kbit`` from now on (what is queued stays queued)."""
        subprocess.run(["tc", "-n", self.namespace, "qdisc", "change", "dev", self.device,
                        "root", "tbf", "rate", f"{rate_kbit}kbit", "burst", self.burst,
                        "limit", self.limit], check=True, capture_output=True, timeout=10)

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        """``command`` inside the namespace."""
        return subprocess.run(["ip", "netns", "exec", self.namespace, *command], **kwargs)

    def popen(self, command: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *command], **kwargs)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _no_ipv6(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=10)


def _wait_up(show: list[str], timeout: float = 10.0) -> None:
    """Until the link ``show`` lists has its carrier (``state UP``): a client started
    before would see the network change under it."""
    deadline = time.monotonic() + scaled(timeout)
    while "state UP" not in subprocess.run(show, capture_output=True, text=True,
                                           timeout=10).stdout:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{' '.join(show)}: not up within {timeout:g} s")
        time.sleep(0.05)


@contextlib.contextmanager
def slow_link(rate_kbit: int, index: int = 0, burst: str = "4kb",
              limit: str = "48kb") -> Iterator[Link]:
    """A namespace whose uplink to the host carries ``rate_kbit`` kbit/s; ``index`` tells
    apart the links of one process (addresses 10.231.N.0/30, N from the pid and index)."""
    tag = f"{os.getpid() % 1000}x{index}"
    namespace, host_if, ns_if = f"cvlink{tag}", f"cvh{tag}", f"cvn{tag}"
    subnet = (os.getpid() * 7 + index) % 250 + 1
    host_ip, client_ip = f"10.231.{subnet}.1", f"10.231.{subnet}.2"
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", namespace)
        # IPv4 only: an IPv6 link-local address that appears after duplicate address
        # detection is a network change, on which Chromium aborts the page's loads
        _no_ipv6(["sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{host_if}/disable_ipv6"])
        _no_ipv6(["ip", "netns", "exec", namespace, "sh", "-c",
                  "for c in all default lo; do "
                  "echo 1 > /proc/sys/net/ipv6/conf/$c/disable_ipv6; done"])
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", namespace, "addr", "add", f"{client_ip}/30", "dev", ns_if)
        _ip("-n", namespace, "link", "set", ns_if, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        subprocess.run(["tc", "-n", namespace, "qdisc", "add", "dev", ns_if, "root", "tbf",
                        "rate", f"{rate_kbit}kbit", "burst", burst, "limit", limit],
                       check=True, capture_output=True, timeout=10)
        _wait_up(["ip", "-o", "link", "show", "dev", host_if])
        _wait_up(["ip", "-n", namespace, "-o", "link", "show", "dev", ns_if])
        yield Link(namespace, host_ip, client_ip, ns_if, burst, limit)
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=10)

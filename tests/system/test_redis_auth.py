"""Redis that asks who is connecting: a real 3-primary Redis Cluster that requires a
password, and one Redis that speaks only TLS (Debian's redis-server, certificates made by
openssl here) and requires a password. The whole service runs on each: its user,
password and TLS reach every connection, the relay's pub/sub included (the results come
back), and no process crashes."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from cosyvoice.client import transcribe_pcm

from .. import launcher
from ..cluster import REDIS_SERVER, redis_cluster
from ..helpers import TEST_ENV, fixture_texts, read_pcm, wer
from ..stack import make_certificate

pytestmark = pytest.mark.system

PASSWORD = "s3cret/with:odd@chars"
ENV = {**TEST_ENV, "COSYVOICE_ENGINE": "pocketsphinx"}


def transcribed(url: str) -> str:
    result = transcribe_pcm(url, read_pcm("weather") + b"\0\0" * 8000, 16000, pace="fast")
    assert result.ended and not result.fatal_errors
    return " ".join(f["text"] for f in result.finals)


def test_a_cluster_that_requires_a_password_serves_sessions(artifacts):
    with redis_cluster(masters=3, password=PASSWORD) as cluster:
        url = ",".join(f"redis://:{quote(PASSWORD, safe='')}@{n.address}"
                       for n in cluster.nodes)
        svc = launcher.start_service(url, processes=1, logs=artifacts, name="cluster-auth",
                                     env={**ENV, "COSYVOICE_REDIS_CLUSTER": "true"})
        try:
            text = transcribed(svc.url)
            alive = svc.gateway.proc.poll() is None and svc.pool.proc.poll() is None
        finally:
            svc.stop()
        keys = sum(n.client().dbsize() for n in cluster.primaries())
    assert wer(fixture_texts()["weather"], text) <= 0.2
    assert alive and keys > 0  # the service's keys are on the cluster


@pytest.fixture
def tls_redis(tmp_path: Path):
    """Debian's redis-server on a TLS port only, requiring a password."""
    if not shutil.which(REDIS_SERVER):
        raise RuntimeError(f"{REDIS_SERVER} is needed (Debian's redis-server; .ci/run "
                           "installs it)")
    cert, key = make_certificate(tmp_path)
    port = launcher.free_port()
    proc = subprocess.Popen(
        [REDIS_SERVER, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
         "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--logfile", str(tmp_path / "redis.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("the TLS redis-server did not start")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    launcher.wait_for(listening, timeout=10)
    yield port, cert
    proc.terminate()
    proc.wait(10)


def test_a_tls_redis_that_requires_a_password_serves_sessions(tls_redis, artifacts):
    port, ca = tls_redis
    url = f"rediss://:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"
    plain = redis.Redis(port=port, socket_timeout=2)
    with pytest.raises(redis.ConnectionError):  # it speaks only TLS
        plain.ping()
    svc = launcher.start_service(url, processes=1, logs=artifacts, name="tls-redis",
                                 env={**ENV, "COSYVOICE_REDIS_CA_FILE": str(ca)})
    try:
        text = transcribed(svc.url)
        alive = svc.gateway.proc.poll() is None and svc.pool.proc.poll() is None
    finally:
        svc.stop()
    assert wer(fixture_texts()["weather"], text) <= 0.2 and alive
    direct = redis.Redis.from_url(url, ssl_ca_certs=str(ca))
    assert direct.dbsize() > 0  # the service's keys, over TLS
    direct.close()

"""The production deployment, with real parts: nginx (TLS, from Debian) in front of two
gunicorn gateway instances (one with two processes), two ASR worker pools and Redis.

The commands are docker-compose.yml's and nginx runs deploy/nginx.conf rendered the way
docs/deployment.md tells operators to (see tests/stack.py).
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import requests
import yaml

from cosyvoice.store.embedded_redis import EmbeddedRedis
from cosyvoice.wire.protocol import encode_chunk

from .. import launcher
from ..helpers import FIXTURES, ROOT, TEST_ENV, direct_decode, fixture_texts, read_pcm, wer
from ..launcher import Gateway, WorkerPool, wait_for
from ..stack import (
    COMPOSE,
    GATEWAY_COMMAND,
    WORKER_COMMAND,
    Nginx,
    Stream,
    nginx_args,
    render,
    render_env,
    scrape,
    start_nginx,
    trusting,
)

pytestmark = pytest.mark.e2e

TEXTS = fixture_texts()
DEBUG_MEM_ENV = {"DEBUG_MEM": "1", "DEBUG_MEM_INTERVAL_S": "1"}
CAPACITY = 4  # sessions per worker pool (one process each)


@dataclass
class Stack:
    redis: EmbeddedRedis
    gateways: list[Gateway]
    workers: list[WorkerPool]
    nginx: Nginx


@pytest.fixture(scope="module")
def stack(tmp_path_factory, artifacts):
    work = tmp_path_factory.mktemp("deploy")
    started: list[subprocess.Popen] = []
    try:
        with launcher.redis_server(work / "redis") as redis_server:
            try:
                yield Stack(redis_server, *_start_parts(redis_server.url, work, started))
            finally:
                launcher.stop(*started)
    finally:
        for log in work.rglob("*.log"):
            shutil.copy(log, artifacts / ("deploy-" + "-".join(log.relative_to(work).parts)))


def _start_parts(redis_url: str, work: Path, started: list[subprocess.Popen]
                 ) -> tuple[list[Gateway], list[WorkerPool], Nginx]:
    """Two gateway instances, two worker pools and nginx; each process goes into
    ``started`` as soon as it runs, for the caller to stop."""
    gateways = [launcher.start_gateway(redis_url, gunicorn=True, processes=1,
                                       env={**TEST_ENV, **DEBUG_MEM_ENV}, logs=work,
                                       name="gateway-a")]
    started.append(gateways[0].proc)
    gateways.append(launcher.start_gateway(redis_url, gunicorn=True, processes=2, env=TEST_ENV,
                                           logs=work, name="gateway-b"))
    started.append(gateways[1].proc)
    # Room for every session the tests hold at once (admission control refuses more).
    workers = [launcher.start_worker_pool(redis_url, capacity=CAPACITY, metrics=True,
                                          env=DEBUG_MEM_ENV, logs=work, name="worker-1",
                                          wait=False)]
    started.append(workers[0].proc)
    workers.append(launcher.start_worker_pool(redis_url, capacity=CAPACITY, metrics=True,
                                              logs=work, name="worker-2", wait=False))
    started.append(workers[1].proc)
    launcher.wait_workers(redis_url, 2)
    nginx = start_nginx(work / "nginx", [g.url.removeprefix("http://") for g in gateways])
    started.insert(0, nginx.proc)
    return gateways, workers, nginx


def https(stack: Stack) -> requests.Session:
    return trusting(stack.nginx.ca)


# ---- the shipped files -------------------------------------------------------------------


def test_compose_runs_the_commands_these_tests_run():
    services = COMPOSE["services"]
    gateways = [name for name in services if name.startswith("gateway")]
    assert len(gateways) >= 2, "nginx balances several gateway instances"
    for name in gateways:
        assert services[name]["command"] == GATEWAY_COMMAND
    assert services["worker"]["command"] == WORKER_COMMAND
    assert "container_name" not in services["worker"] and "ports" not in services["worker"], \
        "the worker scales with --scale"
    nginx = services["nginx"]
    assert "./deploy/nginx.conf:/etc/nginx/templates/nginx.conf.template:ro" in nginx["volumes"]
    upstreams = nginx["environment"]["NGINX_UPSTREAMS"]
    assert all(f"server {name}:8000;" in upstreams for name in gateways)
    # Every placeholder of nginx.conf is substituted by the render script, set for the
    # image's envsubst, and set by the test.
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    placeholders = set(re.findall(r"\$\{(NGINX_[A-Z_]+)\}", conf))
    script = (ROOT / "deploy" / "render-nginx.sh").read_text()
    assert placeholders == set(re.findall(r"\$\{(NGINX_[A-Z_]+)\}", script.splitlines()[-1]))
    assert placeholders <= set(nginx["environment"])
    assert placeholders == set(render_env(80, 443, ROOT, ROOT, ["x:1"], ROOT))


def _compose_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"],
                                 capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    assert legacy, "neither `docker compose` nor docker-compose is installed (.ci/run installs it)"
    return [legacy]


def test_compose_file_passes_docker_compose_config():
    proc = subprocess.run([*_compose_cli(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_cluster_variant_runs_every_process_on_the_cluster():
    """docker-compose.cluster.yml over docker-compose.yml: six cluster nodes, the one-shot
    service that forms the cluster, and every gateway and worker on the cluster, after it
    is formed. (Checked as docker compose reads it; no Docker daemon runs here.)"""
    proc = subprocess.run([*_compose_cli(), "-f", str(ROOT / "docker-compose.yml"), "-f",
                           str(ROOT / "docker-compose.cluster.yml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    nodes = ["redis", *(f"redis-{i}" for i in range(2, 7))]
    for node in nodes:
        assert "--cluster-enabled" in services[node]["command"], node
    assert "--cluster-replicas 1" in " ".join(services["redis-cluster"]["command"])
    for name in ("gateway-1", "gateway-2", "worker"):
        env = services[name]["environment"]
        assert env["COSYVOICE_REDIS_CLUSTER"] == "true", name
        assert env["COSYVOICE_REDIS_URL"].split(",") == [f"redis://{n}:6379" for n in nodes]
        assert services[name]["depends_on"]["redis-cluster"]["condition"] \
            == "service_completed_successfully"
    assert services["gateway-1"]["command"] == GATEWAY_COMMAND
    assert services["worker"]["command"] == WORKER_COMMAND


def test_the_gpu_variant_runs_the_workers_from_the_cuda_image_on_the_gpus():
    """docker-compose.gpu.yml over docker-compose.yml: the worker is built from
    Dockerfile.cuda, decodes on CUDA and reserves the host's GPUs; the rest is the CPU
    deployment's. (Checked as docker compose reads it; no Docker daemon runs here.)"""
    proc = subprocess.run([*_compose_cli(), "-f", str(ROOT / "docker-compose.yml"), "-f",
                           str(ROOT / "docker-compose.gpu.yml"), "config"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    worker = services["worker"]
    assert worker["build"]["dockerfile"] == "Dockerfile.cuda"
    assert worker["command"] == WORKER_COMMAND
    assert worker["environment"]["COSYVOICE_DEVICE"] == "cuda"
    assert {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]} in \
        worker["deploy"]["resources"]["reservations"]["devices"]
    assert services["gateway-1"]["command"] == GATEWAY_COMMAND
    assert "deploy" not in services["gateway-1"]


def _needed_cuda_libraries() -> set[str]:
    """The versioned CUDA libraries the installed CTranslate2 library names (its wheel
    loads them at run time on a GPU), but the driver's own (libcuda) and those only its
    multi-GPU tensor parallelism uses (NCCL, MPI)."""
    import ctranslate2

    site = Path(ctranslate2.__file__).resolve().parent.parent
    names: set[str] = set()
    for lib in (site / "ctranslate2.libs").glob("libctranslate2*"):
        data = lib.read_bytes()
        names |= {m.decode() for m in re.findall(rb"libcu[a-zA-Z]+\.so\.[0-9]+", data)}
    return {n for n in names if not n.startswith("libcuda.")}


def test_the_cuda_image_installs_the_service_as_the_cpu_image_does_and_its_cuda_library():
    cpu = (ROOT / "Dockerfile").read_text()
    cuda = (ROOT / "Dockerfile.cuda").read_text()
    assert re.findall(r"^FROM (.+)$", cuda, re.M) == re.findall(r"^FROM (.+)$", cpu, re.M)
    for line in cpu.splitlines():  # every step of the CPU image, in the same order
        if line.startswith(("RUN ", "COPY ", "USER ", "EXPOSE ")):
            assert line in cuda, line
    needed = _needed_cuda_libraries()
    assert needed, "the ctranslate2 wheel names no CUDA library: check how it loads them"
    # each library NAME.so.MAJOR comes from NVIDIA's wheel nvidia-NAME-cuMAJOR, and its
    # folder is on the loader's path
    for name in sorted(needed):
        match = re.fullmatch(r"lib(cu[a-z]+)\.so\.(\d+)", name)
        assert match, name
        lib, major = match.groups()
        assert re.search(rf"pip install .*nvidia-{lib}-cu{major}==", cuda), name
        assert f"site-packages/nvidia/{lib}/lib" in cuda, name
    assert re.search(r"^ENV COSYVOICE_DEVICE=cuda$", cuda, re.M)


def test_nginx_accepts_the_rendered_config(stack):
    proc = subprocess.run([*nginx_args(stack.nginx.conf, stack.nginx.workdir), "-t"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "test is successful" in proc.stderr


def test_render_substitutes_only_its_own_variables(stack):
    conf = stack.nginx.conf.read_text()
    assert "${NGINX_" not in conf.split("\nuser ", 1)[1]
    for nginx_variable in ("$http_upgrade", "$connection_upgrade", "$http_host",
                           "$proxy_add_x_forwarded_for", "$scheme", "$request_uri"):
        assert nginx_variable in conf
    env = render_env(80, 443, stack.nginx.ca, stack.nginx.ca, ["127.0.0.1:1"], stack.nginx.workdir)
    del env["NGINX_TLS_KEY"]
    proc = render(env)
    assert proc.returncode != 0 and "NGINX_TLS_KEY" in proc.stderr


# ---- through nginx -----------------------------------------------------------------------


def test_speech_over_wss_through_nginx_reaches_both_gateways(stack):
    names = ["weather", "coffee"]
    streams = [Stream(stack.nginx.url, ca=stack.nginx.ca).connect() for _ in names]
    try:
        # Opened straight over WebSocket, and the server offers no other transport.
        assert [s.handshake["upgrades"] for s in streams] == [[], []]
        with ThreadPoolExecutor(len(names)) as pool:
            acks = list(pool.map(lambda sn: sn[0].send_pcm(read_pcm(sn[1])),
                                 zip(streams, names, strict=True)))
        assert all("error" not in a for ack in acks for a in ack)
        for stream, name in zip(streams, names, strict=True):
            assert stream.wait_end(60), f"{name}: no end"
            assert not stream.errors
            reference = TEXTS[name]
            direct = direct_decode(read_pcm(name))
            assert wer(reference, stream.text) <= wer(reference, direct) + 0.01
    finally:
        for s in streams:
            s.close()
    gateways = {g.url.removeprefix("http://") for g in stack.gateways}

    def upstreams() -> set[str]:  # nginx logs a WebSocket when it has closed
        return {json.loads(line)["upstream"] for line in stack.nginx.access_log()
                if '"GET /socket.io/"' in line and '"status":101' in line}

    # least_conn: two sessions open at once go to the two instances.
    wait_for(lambda: len(upstreams()) >= len(gateways), timeout=20)
    assert upstreams() == gateways


def test_openai_clients_transcribe_files_through_nginx(stack, tmp_path):
    """The stock ``openai`` client, pointed at nginx: the models, a file in JSON and as
    streamed deltas, and an upload larger than nginx lets through answered in OpenAI's
    shape (25.5 MB: nginx passes it on, the gateway's limit is 25 MB)."""
    import openai

    upload = ("weather.wav", (FIXTURES / "weather.wav").read_bytes(), "audio/wav")
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=stack.nginx.ca),
                                     trust_env=False)
    with openai.OpenAI(base_url=stack.nginx.url + "/v1", api_key="unused", max_retries=3,
                       http_client=http) as client:
        assert "whisper-1" in [m.id for m in client.models.list()]
        r = client.audio.transcriptions.create(model="whisper-1", file=upload, language="en")
        events = list(client.audio.transcriptions.create(model="whisper-1", file=upload,
                                                         language="en", stream=True))
        with pytest.raises(openai.APIStatusError) as err:
            client.audio.transcriptions.create(
                model="whisper-1", file=("big.wav", b"\0" * (51 * 512 * 1024), "audio/wav"))
    assert wer(TEXTS["weather"], r.text) <= wer(TEXTS["weather"],
                                                 direct_decode(read_pcm("weather"))) + 0.01
    done = events[-1]
    assert done.type == "transcript.text.done" and done.text == r.text
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == r.text
    assert err.value.status_code == 413 and err.value.code == "file_too_large"


def test_openai_realtime_clients_stream_through_nginx(stack):
    """The stock ``openai`` realtime client over wss through nginx: server VAD gives the
    sentence as a completed item."""
    import base64

    import openai

    from cosyvoice.wire.codecs import resample

    audio = resample(read_pcm("weather") + b"\0\0" * 16000, 16000, 24000)
    tls = ssl.create_default_context(cafile=stack.nginx.ca)
    with openai.OpenAI(base_url=stack.nginx.url + "/v1", api_key="unused",
                       websocket_base_url=stack.nginx.url.replace("https", "wss", 1) + "/v1",
                       max_retries=0) as client, client.realtime.connect(
            extra_query={"intent": "transcription"},
            # passed on to websockets' connect; the SDK's type names fewer options
            websocket_connection_options=cast(Any, {"ssl": tls})) as conn:
        assert conn.recv().type == "session.created"
        for i in range(0, len(audio), 4800):
            conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + 4800]).decode())
        done = next(e for e in conn
                    if e.type == "conversation.item.input_audio_transcription.completed")
    assert wer(TEXTS["weather"], done.transcript) <= wer(
        TEXTS["weather"], direct_decode(read_pcm("weather"))) + 0.01


def test_deepgram_clients_stream_and_upload_through_nginx(stack, monkeypatch):
    """The stock ``deepgram-sdk`` over wss and https through nginx: a live stream's final
    and Metadata, and the same sentence as a pre-recorded upload."""
    import httpx
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    # the live socket takes no TLS context: websockets' default one reads SSL_CERT_FILE
    monkeypatch.setenv("SSL_CERT_FILE", str(stack.nginx.ca))
    host = stack.nginx.url.split("://", 1)[1]
    http = httpx.Client(verify=ssl.create_default_context(cafile=stack.nginx.ca), timeout=60)
    dg = DeepgramClient(api_key="unused", httpx_client=http,
                        environment=DeepgramClientEnvironment(
                            base=f"https://{host}", production=f"wss://{host}",
                            agent=f"wss://{host}", agent_rest=f"https://{host}"))
    audio = read_pcm("weather") + b"\0\0" * 16000
    with dg.listen.v1.connect(model="nova-3", encoding="linear16", sample_rate=16000) as ws:
        for i in range(0, len(audio), 3200):
            ws.send_media(audio[i:i + 3200])
        ws.send_close_stream()
        seen = []
        for message in ws:
            seen.append(message)
            if message.type == "Metadata":
                break
    live = " ".join(m.channel.alternatives[0].transcript for m in seen
                    if m.type == "Results" and m.is_final)
    with http:
        upload = dg.listen.v1.media.transcribe_file(
            request=(FIXTURES / "weather.wav").read_bytes(), model="nova-3")
    bound = wer(TEXTS["weather"], direct_decode(read_pcm("weather"))) + 0.01
    assert wer(TEXTS["weather"], live) <= bound
    assert wer(TEXTS["weather"], upload.results.channels[0].alternatives[0].transcript) <= bound
    assert seen[-1].type == "Metadata"


def test_plain_http_redirects_to_https(stack):
    url = f"http://127.0.0.1:{stack.nginx.http_port}/static/x.js?v=1"
    response = requests.get(url, allow_redirects=False, timeout=10)
    assert response.status_code == 301
    assert response.headers["Location"] == "https://127.0.0.1/static/x.js?v=1"


def test_page_comes_with_security_headers(stack):
    response = https(stack).get(stack.nginx.url + "/", timeout=10)
    assert response.status_code == 200 and "cosyvoice" in response.text
    headers = response.headers
    csp = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
    assert csp["default-src"] == "'self'" and csp["connect-src"] == "'self'"
    assert csp["script-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert "'unsafe-inline'" not in headers["Content-Security-Policy"]
    assert headers["Strict-Transport-Security"].startswith("max-age=")
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert "microphone=(self)" in headers["Permissions-Policy"]
    # Errors carry them too.
    not_found = https(stack).get(stack.nginx.url + "/nope", timeout=10)
    assert "Content-Security-Policy" in not_found.headers


def _handshake(stack: Stack, version: str) -> subprocess.CompletedProcess:
    # SECLEVEL=0 lets this client offer the old protocols, so the server is what refuses.
    return subprocess.run(["openssl", "s_client",
                           "-connect", f"127.0.0.1:{stack.nginx.https_port}", version,
                           "-cipher", "DEFAULT@SECLEVEL=0", "-CAfile", str(stack.nginx.ca)],
                          input="", capture_output=True, text=True, timeout=30)


def test_tls_is_1_2_or_1_3_only(stack):
    for version in ("-tls1_2", "-tls1_3"):
        proc = _handshake(stack, version)
        assert proc.returncode == 0 and "Verify return code: 0 (ok)" in proc.stdout, proc.stderr
        assert "Cipher is (NONE)" not in proc.stdout
    for version in ("-tls1", "-tls1_1"):
        proc = _handshake(stack, version)
        assert proc.returncode != 0 and "alert protocol version" in proc.stderr, proc.stderr


def test_request_bodies_are_limited_to_one_chunk(stack):
    url = stack.nginx.url + "/socket.io/?EIO=4&transport=polling"
    session = https(stack)
    chunk_sized = session.post(url, data=b"\0" * 97_088, timeout=10)
    assert chunk_sized.status_code != 413, "a maximal chunk fits"
    assert session.post(url, data=b"\0" * 200_000, timeout=10).status_code == 413
    assert session.post(stack.nginx.url + "/", data=b"x", timeout=10).status_code == 403


def test_metrics_are_not_served_to_the_public(stack):
    assert https(stack).get(stack.nginx.url + "/metrics", timeout=10).status_code == 404
    assert requests.get(stack.gateways[0].url + "/metrics", timeout=10).status_code == 200


# ---- metrics, processes, logs -----------------------------------------------------------


def _gateway_totals(gateway: Gateway) -> dict[str, float]:
    return scrape(gateway.url + "/metrics")


def test_gateway_metrics_add_up_its_processes_and_move_with_traffic(stack):
    gateway = stack.gateways[1]  # two processes
    before = _gateway_totals(gateway)
    pcm = read_pcm("door")[:6400 * 3]
    streams = [Stream(gateway.url).connect() for _ in range(4)]
    try:
        wait_for(lambda: _gateway_totals(gateway)["cosyvoice_sessions_active"] >= 4, timeout=20)
        for stream in streams:
            for seq in range(3):
                chunk = pcm[seq * 6400:(seq + 1) * 6400]
                assert stream.send(encode_chunk(chunk, seq)) == {"seq": seq}
            assert stream.send(encode_chunk(pcm[:6400], 0)) == {"seq": 0, "duplicate": True}
            assert stream.send(b"\xff junk")["error"] == "bad_chunk"
            # 1.5 s of audio: over COSYVOICE_MAX_CHUNK_MS
            assert stream.send(encode_chunk(b"\0" * 48_000, 3))["error"] == "too_large"
        # Every scrape, whichever process answers it, sees all four sessions' chunks.
        for _ in range(4):
            after = _gateway_totals(gateway)
            delta = {k: after[k] - before.get(k, 0.0) for k in after}
            assert delta['cosyvoice_chunks_accepted_total{result="stored"}'] == 12
            assert delta['cosyvoice_chunks_accepted_total{result="duplicate"}'] == 4
            assert delta['cosyvoice_chunks_rejected_total{code="bad_chunk"}'] == 4
            assert delta['cosyvoice_chunks_rejected_total{code="too_large"}'] == 4
            assert delta["cosyvoice_chunk_ack_seconds_count"] == 16
            ack_seconds = "cosyvoice_chunk_ack_seconds_sum"
            assert after[ack_seconds] > before[ack_seconds]
    finally:
        for stream in streams:
            stream.close(stop=True)
    wait_for(lambda: _gateway_totals(gateway)["cosyvoice_sessions_active"] == 0, timeout=20)


def _worker_totals(stack: Stack) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pool in stack.workers:
        assert pool.metrics_url is not None
        for key, value in scrape(pool.metrics_url).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def test_worker_metrics_show_load_capacity_and_decode_lag(stack):
    partial_waits = 'cosyvoice_decode_wait_seconds_count{kind="partial"}'
    before = _worker_totals(stack)
    assert before["cosyvoice_worker_capacity"] == 2 * CAPACITY  # two pools of one process
    assert "cosyvoice_chunks_accepted_total" not in str(before), "gateway metrics stay on gateways"
    stream = Stream(stack.gateways[0].url).connect()
    try:
        chunks = read_pcm("weather")
        # 1.6 s of speech: results to publish (whisper-live's first partial needs 1 s)
        for seq in range(8):
            chunk = chunks[seq * 6400:(seq + 1) * 6400]
            assert stream.send(encode_chunk(chunk, seq)) == {"seq": seq}
        wait_for(lambda: _worker_totals(stack)["cosyvoice_worker_sessions"] == 1, timeout=20)
        wait_for(lambda: _worker_totals(stack)["cosyvoice_decode_lag_seconds_count"]
                 > before["cosyvoice_decode_lag_seconds_count"], timeout=20)
        # the decode scheduler's queue, exported at the next lease renewal
        wait_for(lambda: _worker_totals(stack).get(partial_waits, 0)
                 > before.get(partial_waits, 0), timeout=20)
    finally:
        stream.close(stop=True)
    after = _worker_totals(stack)
    assert after["cosyvoice_decode_lag_seconds_sum"] > before["cosyvoice_decode_lag_seconds_sum"]


def test_gunicorn_runs_the_configured_processes_without_a_control_socket(stack):
    for gateway, processes in zip(stack.gateways, (1, 2), strict=True):
        children = psutil.Process(gateway.proc.pid).children()
        assert len(children) == processes
        assert gateway.home is not None and not (gateway.home / ".gunicorn").exists()


def _log_lines(part: Gateway | WorkerPool) -> list[dict]:
    """Every complete line of a process's log, parsed (each must be JSON)."""
    assert part.log is not None
    text = part.log.read_text()
    complete = text[:text.rfind("\n") + 1]  # a line being written is not finished yet
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _events(parts: list[Gateway] | list[WorkerPool], sid: str) -> set[str | None]:
    return {r.get("event") for part in parts for r in _log_lines(part)
            if r.get("session") == sid}


def test_logs_are_json_lines_with_session_and_event_and_no_transcript(stack):
    stream = Stream(stack.gateways[0].url).connect()
    try:
        stream.send_pcm(read_pcm("shells"))
        assert stream.wait_end(60)
    finally:
        stream.close()
    sid = stream.session["session"]
    wait_for(lambda: {"connect", "disconnect"} <= _events(stack.gateways[:1], sid))
    wait_for(lambda: {"claim", "finish"} <= _events(stack.workers, sid))
    assert len(stream.text.split()) >= 3
    for part in stack.gateways + stack.workers:
        records = _log_lines(part)  # every line parses
        assert all({"time", "level", "logger", "pid", "msg"} <= r.keys() for r in records)
        assert all(r["level"] != "DEBUG" for r in records)
        text = part.log.read_text()
        for final in stream.finals:
            assert final["text"] not in text, "transcript text in the logs"
    assert any(r["logger"] == "gunicorn.error" for r in _log_lines(stack.gateways[1]))


def test_debug_mem_logs_top_allocations_and_rss_in_gateway_and_worker(stack):
    for part in (stack.gateways[0], stack.workers[0]):
        def dumps(part: Gateway | WorkerPool = part) -> list[dict]:
            return [r for r in _log_lines(part) if r.get("event") == "debug_mem" and "top" in r]
        records = wait_for(dumps, timeout=30)
        assert 0 < len(records[-1]["top"]) <= 20
        assert records[-1]["rss"] > 0
        assert all({"where", "size_diff", "count_diff"} <= t.keys() for t in records[-1]["top"])
    assert not any(r.get("event") == "debug_mem" for r in _log_lines(stack.gateways[1]))

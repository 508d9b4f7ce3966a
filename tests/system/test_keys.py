"""Keys and usage through the running service (real gateway and worker, real Redis): API
keys from a keys file and signed tokens accepted on every face, a bad key refused on each,
and the audio each key sent counted per day (``cosyvoice usage``) and in the gateway's
metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import requests
from websockets.exceptions import InvalidStatus

from cosyvoice.client import Refused, StreamingClient, transcribe_pcm
from cosyvoice.gateway import apikeys, tokens

from .. import launcher
from ..helpers import FIXTURES, TEST_ENV, read_pcm
from ..launcher import wait_for

pytestmark = pytest.mark.system

SECRET = "keys-test-secret"


@pytest.fixture(scope="module")
def keyed(module_redis, artifacts, tmp_path_factory):
    """A service with a keys file of two teams and a token secret (the null engine: who
    sent the audio matters here, not what it said)."""
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    keys = {name: apikeys.add(path, name) for name in ("team-a", "team-b")}
    svc = launcher.start_service(module_redis.url, processes=1, logs=artifacts, name="keys",
                                 env={**TEST_ENV, "COSYVOICE_ENGINE": "null",
                                      "COSYVOICE_API_KEYS_FILE": str(path),
                                      "COSYVOICE_AUTH_SECRET": SECRET})
    yield svc, keys
    svc.stop()


def usage(svc) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "cosyvoice", "usage", "--json",
                          "--redis-url", svc.redis_url], capture_output=True, text=True,
                         timeout=30, check=True)
    days = json.loads(out.stdout)
    return {name: s for day in days.values() for name, s in day.items()}


def test_every_face_takes_a_key_and_counts_its_audio(keyed):
    svc, keys = keyed
    weather = len(read_pcm("weather")) / 32000
    before = usage(svc)
    got = transcribe_pcm(svc.url, read_pcm("weather"), 16000, pace="fast",
                         token=keys["team-a"])
    assert got.ended and not got.errors
    with openai.OpenAI(base_url=svc.url + "/v1", api_key=keys["team-b"],
                       max_retries=0) as client:
        client.audio.transcriptions.create(
            model="whisper-1", file=("w.wav", (FIXTURES / "weather.wav").read_bytes()))
    token = transcribe_pcm(svc.url, read_pcm("weather"), 16000, pace="fast",
                           token=tokens.issue(SECRET, "kiosk-7"))
    assert token.ended and not token.errors

    def added(name: str) -> float:
        return usage(svc).get(name, 0.0) - before.get(name, 0.0)

    # each gateway process writes what it counted every few seconds
    wait_for(lambda: all(added(n) > 0 for n in ("team-a", "team-b", "kiosk-7")), timeout=20)
    for name in ("team-a", "team-b", "kiosk-7"):
        assert added(name) == pytest.approx(weather, abs=0.21)  # chunks of 200 ms
    metrics = requests.get(svc.url + "/metrics", timeout=10).text
    assert 'cosyvoice_audio_seconds_by_key_total{key="team-a"}' in metrics


def test_a_bad_key_is_refused_on_every_face(keyed):
    svc, _keys = keyed
    bad = apikeys.PREFIX + "not-a-key"
    client = StreamingClient(svc.url, token=bad)
    try:
        with pytest.raises(Refused) as refused:
            client.connect()
    finally:
        client.close()
    assert refused.value.code == "unauthorized"
    with openai.OpenAI(base_url=svc.url + "/v1", api_key=bad, max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=svc.url + "/v1", api_key=bad, max_retries=0,
                       websocket_base_url=svc.url.replace("http", "ws", 1) + "/v1") as c:
        with pytest.raises(InvalidStatus) as err:
            with c.realtime.connect(extra_query={"intent": "transcription"}):
                pass
    assert err.value.response.status_code == 401

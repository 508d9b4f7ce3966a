"""The relay delivers a session's results to an output that is not Socket.IO: the queue a
face's own handler reads (an HTTP response, a raw WebSocket), through real Redis and a
real PocketSphinx worker's rounds, each result once and in order."""

from __future__ import annotations

import threading

import pytest
import redis

from cosyvoice.asr import load_model
from cosyvoice.gateway.outputs import QueueOutput
from cosyvoice.gateway.relay import ResultRelay
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.webui import create_app
from cosyvoice.wire.messages import Published
from cosyvoice.worker.loop import Worker

from .. import launcher
from ..helpers import read_pcm, results, rounds_until, write_session

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]


def drain(output: QueueOutput) -> list[tuple[str, Published]]:
    out = []
    while (item := output.get(0.0)) is not None:
        out.append(item)
    return out


def transcribed(redis_url: str, client, session: str) -> list[dict]:
    """A session of real speech decoded by a PocketSphinx worker's rounds, and its stored
    results."""
    worker = Worker(Settings(redis_url=redis_url), load_model("pocketsphinx", Settings()),
                    client)
    worker.bus.ensure_group()
    write_session(worker.bus, session, read_pcm("weather"))
    rounds_until(worker, lambda: session not in worker.sessions, timeout=30)
    return results(client, session)


def test_a_queue_output_gets_every_result_once_in_order(fresh_redis, fresh_redis_client):
    client = fresh_redis_client
    stored = transcribed(fresh_redis.url, client, "q")
    assert stored[-1]["type"] == "end" and any(r["type"] == "final" for r in stored)

    relay = ResultRelay(client, busmod.Bus(client), start=False)
    output = QueueOutput("http-1")
    relay.subscribe("q", output, after="-")  # a reader that has nothing yet
    relay.replay("q")
    got = drain(output)
    assert [message for _, message in got] == stored
    ids = [result_id for result_id, _ in got]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    # the same results again (a replay after a lost subscriber, a live copy) reach
    # the reader no second time
    relay.replay("q")
    relay.deliver(keys.text_key("q"), f"{ids[-1]} {{\"type\":\"end\"}}")
    assert drain(output) == []


def test_a_disconnect_removes_only_its_own_output(fresh_redis, fresh_redis_client):
    client = fresh_redis_client
    relay = ResultRelay(client, busmod.Bus(client), start=False)
    relay.subscribe("s", QueueOutput("old"))
    relay.subscribe("s", QueueOutput("new"))  # the session resumed on another connection
    relay.unsubscribe("s", "old")  # the old connection's late disconnect
    assert relay.routes["s"].output.id == "new"
    relay.unsubscribe("s", "new")
    assert "s" not in relay.routes


def test_a_face_is_one_module_and_one_line_and_reads_results_through_its_output(
        fresh_redis, fresh_redis_client):
    """The example face of docs/architecture.md (tests/example_face.py), installed the way
    ``webui.FACES`` installs faces: its HTTP route answers with the session's results,
    which reach it through the relay and a ``QueueOutput``."""
    client = fresh_redis_client
    stored = transcribed(fresh_redis.url, client, "f")
    app = create_app(Settings(redis_url=fresh_redis.url), client, relay_results=False,
                     faces=("tests.example_face:install",))
    reply = app.test_client().get("/example/sessions/f/results")
    assert reply.status_code == 200
    assert reply.get_json() == stored
    gateway = app.extensions["cosyvoice"]
    assert "f" not in gateway.relay.routes  # the face's output is gone with its request


def test_a_replay_that_cannot_reach_redis_tries_again_and_loses_nothing(tmp_path):
    """The store is gone at the moment a replay reads it (a restart, a failover) and back
    half a second later: the reader still gets every stored result, once."""
    with launcher.redis_server(tmp_path / "redis", persist=True) as server:
        client = redis.Redis.from_url(server.url)
        stored = transcribed(server.url, client, "r")
        relay = ResultRelay(client, busmod.Bus(client), start=False)
        output = QueueOutput("http-1")
        relay.subscribe("r", output, after="-")
        server.kill()
        comeback = threading.Timer(0.5, server.start)
        comeback.start()
        try:
            relay.replay("r")
        finally:
            comeback.join()
        assert [message for _, message in drain(output)] == stored
        client.close()

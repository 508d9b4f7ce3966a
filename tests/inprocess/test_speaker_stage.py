"""Speaker labels in a worker's rounds (real Redis, a real PocketSphinx worker in this
process): a session that asks gets a speaker on each final and its words and the speakers'
state in its stored checkpoint; a session that does not ask costs nothing: the worker
never starts the speaker embedder for it."""

from __future__ import annotations

import json

import pytest

from cosyvoice.asr import load_model
from cosyvoice.settings import Settings
from cosyvoice.store import keys
from cosyvoice.worker.loop import Worker

from ..helpers import attributed, conversation, results, rounds_until, write_session

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]


def decoded(worker: Worker, client, sid: str, pcm: bytes, options: dict) -> list[dict]:
    write_session(worker.bus, sid, pcm)
    if options:
        client.hset(keys.session_key(sid), mapping=options)  # before any round adopts it
    rounds_until(worker, lambda: sid not in worker.sessions, timeout=120)
    return results(client, sid)


def test_labels_cost_nothing_unless_asked_and_come_on_every_engine(fresh_redis,
                                                                   fresh_redis_client):
    client = fresh_redis_client
    worker = Worker(Settings(redis_url=fresh_redis.url), load_model("pocketsphinx", Settings()),
                    client)
    worker.bus.ensure_group()
    pcm, truth = conversation(["speakers/slt1", "speakers/kal1", "speakers/slt2",
                               "speakers/kal2"], gaps=[1.0, 1.0, 1.0])
    plain = decoded(worker, client, "plain", pcm, {})
    assert [r for r in plain if r["type"] == "final"]
    assert all("speaker" not in r for r in plain)
    assert worker._embedder.thread is None  # no thread, no model loaded, no audio kept

    # the checkpoint stored with a final holds the speakers' state
    seen_checkpoints: list[dict] = []
    publish = worker.bus.publish_results

    def watching(sid, messages, ttl, checkpoint, done=False):
        if checkpoint is not None and not checkpoint.done:
            seen_checkpoints.append(json.loads(checkpoint.to_json()))
        return publish(sid, messages, ttl, checkpoint, done=done)
    worker.bus.publish_results = watching  # type: ignore[method-assign,assignment]
    labelled = decoded(worker, client, "labelled", pcm,
                       {"diarize": "live", "min_speakers": "1", "max_speakers": "16"})
    finals = [r for r in labelled if r["type"] == "final" and r["text"]]
    assert worker._embedder.thread is not None
    assert [f["speaker"] for f in finals] == ["S1", "S2", "S1", "S2"]
    assert attributed(finals, truth) >= 0.9
    assert seen_checkpoints and all("speakers" in c and "speakers_pos" in c
                                    for c in seen_checkpoints)
    assert {p[3] for p in seen_checkpoints[-1]["speakers"]["pieces"]} == {0, 1}

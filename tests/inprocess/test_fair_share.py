"""Fair share (docs/security.md): no one client holds more than ``COSYVOICE_CLIENT_SHARE`` of
the live workers' capacity; a client is its API key where keys are asked for, else its
address. In-process (the gateway's test client, a real Redis), with a heartbeat standing in
for workers of a known capacity."""

from __future__ import annotations

import pytest

from cosyvoice.gateway import apikeys
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.webui import create_app
from cosyvoice.wire.protocol import NAMESPACE

from ..flask_client import open_test_client

pytestmark = [pytest.mark.fast, pytest.mark.inprocess]

KEYS = {"alice": apikeys.PREFIX + "alice-key-0000000000000000",
        "bob": apikeys.PREFIX + "bob-key-000000000000000000"}


@pytest.fixture
def app(module_redis, module_redis_client, tmp_path):
    module_redis_client.flushall()
    # workers of capacity 4 in all (no worker decodes in these tests)
    busmod.Bus(module_redis_client).heartbeat("share-stand-in", 4, 600_000)
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{name} {apikeys.digest(key)}\n" for name, key in KEYS.items()))
    return create_app(Settings(redis_url=module_redis.url, api_keys_file=str(keys),
                               client_share=0.5, max_sessions_per_client=20,
                               rate_limit_factor=0),
                      module_redis_client, relay_results=False)


def connect(app, name):
    return open_test_client(app, auth={"token": KEYS[name]})


def test_a_client_holds_at_most_its_share_and_another_client_still_gets_in(app):
    alice = [connect(app, "alice") for _ in range(2)]  # half of 4
    assert all(c.is_connected(NAMESPACE) for c in alice)
    third = connect(app, "alice")
    assert not third.is_connected(NAMESPACE)
    refusal = third.refusal
    assert refusal["code"] == "rate_limited"
    assert "COSYVOICE_CLIENT_SHARE" in refusal["msg"] and refusal["retry_after_ms"] > 0
    bob = [connect(app, "bob") for _ in range(2)]  # the other half is there for bob
    assert all(c.is_connected(NAMESPACE) for c in bob)
    # a session alice ends frees her place
    assert alice[0].emit("stop", namespace=NAMESPACE, callback=True)["stopped"] is True
    again = connect(app, "alice")
    assert again.is_connected(NAMESPACE)
    for c in [*alice, *bob, again]:
        if c.is_connected(NAMESPACE):
            c.disconnect(NAMESPACE)


def test_a_disconnected_session_keeps_counting_for_its_client_until_its_grace_ends(app):
    first, second = connect(app, "alice"), connect(app, "alice")
    first.disconnect(NAMESPACE)  # it may resume: its place is kept for the grace period
    third = connect(app, "alice")
    assert not third.is_connected(NAMESPACE) and third.refusal["code"] == "rate_limited"
    second.disconnect(NAMESPACE)


def test_the_share_is_at_least_one_session(module_redis, module_redis_client, tmp_path):
    module_redis_client.flushall()
    busmod.Bus(module_redis_client).heartbeat("share-stand-in", 1, 600_000)
    app = create_app(Settings(redis_url=module_redis.url, client_share=0.1,
                              rate_limit_factor=0),
                     module_redis_client, relay_results=False)
    client = open_test_client(app)  # no keys asked for: the client is its address
    assert client.is_connected(NAMESPACE)
    client.disconnect(NAMESPACE)

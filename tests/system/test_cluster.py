"""The Redis layer on a real Redis Cluster (three primaries, Debian's redis-server 7): every
command stays within one slot, sessions spread over the primaries and leave nothing
behind, and a node that lost its scripts gets them again. The service on a cluster runs
the pipeline tests (tests/system/test_pipeline.py, ``cluster``)."""

from __future__ import annotations

import pytest

from cosyvoice.store import bus as busmod
from cosyvoice.store import keys
from cosyvoice.wire.messages import Checkpoint, Published
from cosyvoice.wire.protocol import encode_chunk

pytestmark = pytest.mark.system

SESSIONS = 1000


@pytest.fixture
def bus(cluster):
    """A Bus on the tests' cluster, emptied before and after (other tests' services
    leave their control keys and the sweeper's lock there)."""
    cluster.reset()
    client = busmod.connect(cluster.url, cluster=True)
    yield busmod.Bus(client)
    for node in cluster.primaries():
        node.client().flushall()
    client.close()


def _final(text: str) -> Published:
    return {"type": "final", "text": text, "utterance": 0, "start": 0.0, "end": 1.0}


def test_sessions_spread_over_the_primaries_and_leave_only_the_control_keys(bus, cluster):
    assert bus.cluster and bus.k == keys.CLUSTER_CONTROL
    bus.ensure_group()
    bus.heartbeat("w1", SESSIONS, 10_000)
    idle = cluster.key_counts()
    sids = [f"s{i}" for i in range(SESSIONS)]
    for sid in sids:
        bus.create_session(sid, 16000)
        assert bus.admit(sid).admitted
    claimed: list[busmod.Announcement] = []
    while len(claimed) < SESSIONS:
        _newest, got = bus.place("w1", SESSIONS, SESSIONS - len(claimed), 0, 1000)
        assert got, "placement stopped before every session was placed"
        claimed += got
    assert sorted(a.sid for a in claimed) == sorted(sids)
    replies = bus.append_chunks([(sid, 0, encode_chunk(b"\0" * 6400, 0), 16000, False)
                                 for sid in sids])
    assert all(r.status == busmod.AppendStatus.APPENDED for r in replies)
    assert {sid: len(e) for sid, e in bus.read_audio(dict.fromkeys(sids, "0-0"), 5, 50).items()} \
        == dict.fromkeys(sids, 1)
    for sid in sids:
        assert bus.take_lease(sid, "w1", 10_000)
    assert set(bus.renew_leases(sids, "w1", 10_000).values()) == {1}
    for sid in sids[:10]:
        assert bus.publish_results(sid, [_final(sid)], 60, Checkpoint("1-0", 0, {"rate": 16000}))
        [(_id, payload)] = bus.results_after(sid)
        assert sid in payload
    busy = cluster.key_counts()
    # each session's hash, audio stream and lease, ten result streams, the control keys
    assert sum(busy.values()) == 3 * SESSIONS + 10 + 3
    assert all(n > SESSIONS // 2 for n in busy.values()), f"sessions did not spread: {busy}"
    for sid in sids:
        bus.delete_session(sid)
    assert bus.open_sessions() == 0
    # the control keys, on the one primary that holds their hash tag, and from the first
    # session that ended on, the record of when the last ones did (the drain rate)
    assert sorted(n for n in idle.values() if n) == [3]
    after = cluster.key_counts()
    assert sorted(n for n in after.values() if n) == [4]
    assert {node for node, n in after.items() if n} == {node for node, n in idle.items() if n}
    assert bus.r.zcard(bus.k.ended) == min(SESSIONS, busmod.ENDS_KEPT)  # bounded


def _flush_scripts(cluster) -> None:
    for node in cluster.primaries():
        node.client().script_flush()


def test_a_primary_that_lost_its_scripts_gets_them_again(bus, cluster):
    bus.create_session("s", 16000)
    bus.announce("s")
    assert bus.take_lease("s", "w1", 10_000)
    _flush_scripts(cluster)
    [reply] = bus.append_chunks([("s", 0, encode_chunk(b"\0" * 640, 0), 16000, False)])
    assert reply.status == busmod.AppendStatus.APPENDED
    _flush_scripts(cluster)
    assert bus.renew_leases(["s"], "w1", 10_000) == {"s": 1}
    _flush_scripts(cluster)
    assert bus.publish_results("s", [_final("again")], 60)
    assert "again" in bus.results_after("s")[0][1]


def _move_slot(cluster, key: str) -> tuple[int, int]:
    """Move ``key``'s slot, keys and all, to another primary, as a resharding does
    (``CLUSTER SETSLOT`` ... ``MIGRATE``); (from port, to port)."""
    client = cluster.client()
    slot = client.keyslot(key)
    source = client.get_node_from_key(key)
    primaries = {n.port: n for n in cluster.primaries()}
    src = primaries[source.port].client()
    dst_port = next(p for p in primaries if p != source.port)
    dst = primaries[dst_port].client()
    src_id = src.execute_command("CLUSTER", "MYID").decode()
    dst_id = dst.execute_command("CLUSTER", "MYID").decode()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys_in := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys_in)
    for node in primaries.values():
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    client.close()
    return source.port, dst_port


def test_a_session_whose_slot_moved_goes_on_and_the_redirection_is_counted(bus, cluster):
    from prometheus_client import REGISTRY

    def moved() -> float:
        return REGISTRY.get_sample_value("cosyvoice_redis_cluster_redirections_total",
                                         {"kind": "slot_moved"}) or 0.0

    bus.create_session("m", 16000)
    bus.announce("m")
    [first] = bus.append_chunks([("m", 0, encode_chunk(b"\0" * 640, 0), 16000, False)])
    assert first.status == busmod.AppendStatus.APPENDED
    before = moved()
    src, dst = _move_slot(cluster, keys.session_key("m"))
    assert src != dst
    # the client's slot map still names the old node: it is redirected, once
    [second] = bus.append_chunks([("m", 1, encode_chunk(b"\0" * 640, 1), 16000, False)])
    assert second.status == busmod.AppendStatus.APPENDED and second.next_seq == 2
    assert moved() > before
    entries = bus.read_audio({"m": "0-0"}, 5, None)["m"]
    assert len(entries) == 2
    assert bus.r.get_node_from_key(keys.session_key("m")).port == dst

"""The pure rules, without Redis or processes: backoff, the gateway's acks and session
event, the worker's per-entry results and checkpoint, admission and placement (the Lua
rules of cosyvoice/store/lua/rules.lua, run in Lua 5.1 as Redis runs them), the client's
send window, and the client's handlers driven from several threads with events out of
order."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lupa import lua51

from cosyvoice.client import ABR_IN_FLIGHT, MAX_IN_FLIGHT, SendWindow, StreamingClient
from cosyvoice.faces.socketio import error_ack, session_event
from cosyvoice.gateway.core import Connection, ack_for, session_limits
from cosyvoice.settings import Settings
from cosyvoice.store import bus as busmod
from cosyvoice.store import scripts
from cosyvoice.store.backoff import Backoff
from cosyvoice.text.finals import Context, Job
from cosyvoice.wire.errors import BadChunk, Internal, SeqGap, SessionLost
from cosyvoice.wire.messages import Checkpoint, Result, Scheduled, to_event
from cosyvoice.wire.protocol import NAMESPACE
from cosyvoice.worker.outbox import entry_results

pytestmark = [pytest.mark.fast, pytest.mark.unit]


# ---- backoff ------------------------------------------------------------------------------


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_success():
    backoff = Backoff(first_s=0.1, max_s=1.0)
    assert [backoff.failed() for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.succeeded()
    assert backoff.failed() == 0.1


# ---- gateway ------------------------------------------------------------------------------


def _reply(status: int, next_seq: int = 0) -> busmod.AppendResult:
    return busmod.AppendResult(status, next_seq)


def test_each_append_status_has_its_ack_or_error():
    assert ack_for(_reply(busmod.AppendStatus.APPENDED), 4) == {"seq": 4}
    assert ack_for(_reply(busmod.AppendStatus.DUPLICATE), 4) == {"seq": 4, "duplicate": True}
    with pytest.raises(SeqGap) as gap:
        ack_for(_reply(busmod.AppendStatus.GAP, next_seq=2), 4)
    assert gap.value.to_wire() == {"code": "seq_gap", "msg": "expected seq 2, got 4",
                                   "seq": 4, "expected": 2}
    with pytest.raises(BadChunk, match="already ended"):
        ack_for(_reply(busmod.AppendStatus.ENDED), 4)
    with pytest.raises(SessionLost):  # the store lost it: a new session follows
        ack_for(_reply(busmod.AppendStatus.NO_SESSION), 4)
    with pytest.raises(Internal):
        ack_for(_reply(7), 4)


def test_a_refused_chunk_is_acked_with_its_code_and_seq_when_known():
    assert error_ack(SeqGap(expected=2, got=4)) == {"error": "seq_gap", "seq": 4}
    assert error_ack(BadChunk("not protobuf")) == {"error": "bad_chunk"}


def test_the_session_event_says_where_to_go_on_and_the_limits():
    settings = Settings(max_chunk_ms=800, session_grace_s=5.0)
    settings = settings.replace(opus_bitrates="24000,16000")
    conn = Connection(session="abc", rate=8000, conn_id="sock", client="1.2.3.4", bucket=None,
                      next_seq=7, mode="pocketsphinx", codec="opus", bitrate=24000,
                      options={"language": "zh", "script": "hant", "format": "1",
                               "diarize": "live"})
    event = session_event(conn, True, session_limits(settings))
    assert event == {"session": "abc", "resumed": True, "next_seq": 7, "sample_rate": 8000,
                     "chunk_ms": 200, "mode": "pocketsphinx", "codec": "opus", "bitrate": 24000,
                     "language": "zh", "script": "hant", "format": True,
                     "diarize": "live", "abr": False,
                     "limits": {"max_chunk_ms": 800, "sample_rates": [8000, 16000, 24000, 48000],
                                "grace_s": 5.0, "max_session_s": 14400.0,
                                "rate_limit_factor": 2.0,
                                "codecs": {"pcm16": {"sample_rates": [8000, 16000, 24000, 48000]},
                                           "opus": {"sample_rate": 16000, "frame_ms": 20,
                                                    "bitrates": [24000, 16000]}}}}


# ---- worker -------------------------------------------------------------------------------


def _result(kind, text, **more) -> Result:
    out: Any = {"type": kind, "text": text, "utterance": 0, "start": 0.0, "end": 1.0, **more}
    return out


def test_a_partial_entry_publishes_its_results_and_keeps_the_checkpoint():
    def never():
        raise AssertionError("no checkpoint is due")
    results, checkpoint = entry_results("s", "5-0", 3, False, [_result("partial", "a")], never)
    assert results == [_result("partial", "a", seq=3)] and checkpoint is None


def test_a_final_entry_checkpoints_the_stream_at_that_entry():
    results, checkpoint = entry_results(
        "s", "9-1", 4, False, [_result("final", "b", seq=2)],
        lambda: {"cmn": "x", "utterance": 1})
    assert results == [_result("final", "b", seq=2)]  # an engine's own seq stays
    assert checkpoint == Checkpoint("9-1", 4, {"cmn": "x", "utterance": 1})
    # stored flat: the engine's state with the entry's id and seq beside it
    assert json.loads(checkpoint.to_json()) == {"cmn": "x", "utterance": 1, "id": "9-1", "seq": 4}
    assert Checkpoint.from_json(checkpoint.to_json()) == checkpoint


def test_the_last_entry_ends_the_session_and_marks_it_done():
    results, checkpoint = entry_results("s", "9-2", 5, True, [_result("final", "c")],
                                        lambda: {"x": 1})
    assert results[-1] == {"type": "end", "session": "s", "seq": 5}
    assert results[0] == _result("final", "c", seq=5)
    assert checkpoint == Checkpoint.finished()
    assert json.loads(checkpoint.to_json()) == {"done": True}
    assert Checkpoint.from_json(checkpoint.to_json()).done


def test_deferred_results_get_their_seq_and_the_relay_emits_each_published_kind():
    job = Job(Context(), b"\0\0")
    deferred = Scheduled(_result("final", ""), job)
    [out], _ = entry_results("s", "9-3", 6, False, [deferred], lambda: {"rate": 16000})
    assert isinstance(out, Scheduled) and out.result["seq"] == 6 and out.job is job
    assert to_event("s", "7-0", _result("final", "d", seq=6)) == (
        "text", {**_result("final", "d", seq=6), "id": "7-0"})
    assert to_event("s", "7-1", {"type": "end", "session": "s", "seq": 6}) == (
        "end", {"session": "s", "id": "7-1"})
    assert to_event("s", "7-2", {"type": "error", "code": "internal", "msg": "m"}) == (
        "error", {"code": "internal", "msg": "m"})


# ---- admission and placement (Lua rules) ---------------------------------------------------

RULE_EXAMPLES = settings(max_examples=500, deadline=None)
RULE_NAMES = re.findall(r"^local function (\w+)", scripts.RULES, re.M)


@pytest.fixture(scope="module")
def rules() -> SimpleNamespace:
    """The rules as Redis runs them: the same source, in Lua 5.1 (the version Redis
    embeds), with no ``redis`` object, so a rule that touched Redis would fail here."""
    lua = lua51.LuaRuntime()
    table = lua.execute(scripts.RULES + "\nreturn {"
                        + ", ".join(f"{n} = {n}" for n in RULE_NAMES) + "}")
    return SimpleNamespace(lua=lua, **{name: table[name] for name in RULE_NAMES})


def _age(rules, body: str):
    """A Lua function for takes_new's ``age``, as place.lua passes one. Lua functions, not
    Python callables: lupa 2.8 now and then calls the wrong Python object from Lua when
    many short-lived callables cross over (a TypeError naming a comprehension's '.0')."""
    return rules.lua.eval(f"function() {body} end")


def test_every_control_plane_script_decides_through_the_rules():
    assert "redis." not in scripts.RULES
    assert set(RULE_NAMES) == {"admits", "least_loaded_other", "is_least", "nothing_to_place",
                               "orphan_idle_ms", "takes_new"}
    control = scripts.ADMIT + scripts.PLACE
    assert all(re.search(rf"\b{name}\(", control) for name in RULE_NAMES)


def test_admission_admits_while_open_sessions_are_fewer_than_the_capacity(rules):
    caps = rules.lua.table_from([1, 2])
    assert rules.admits(2, caps) == (True, 3)
    assert rules.admits(3, caps) == (False, 3)
    assert rules.admits(0, rules.lua.table_from([])) == (False, 0)  # no live worker


@given(open_=st.integers(0, 50), caps=st.lists(st.integers(0, 8), max_size=6))
@RULE_EXAMPLES
def test_admission_matches_its_definition(rules, open_, caps):
    assert rules.admits(open_, rules.lua.table_from(caps)) == (open_ < sum(caps), sum(caps))


def _least_other(rules, me, workers):
    """``workers``: {id: (load, capacity)}."""
    ids = list(workers)
    return rules.least_loaded_other(
        me, rules.lua.table_from(ids), rules.lua.table_from([workers[i][1] for i in ids]),
        rules.lua.table_from({i: workers[i][0] for i in ids}))


def test_the_least_loaded_other_worker_is_by_load_over_capacity_and_has_room(rules):
    workers = {"me": (0, 4), "a": (1, 2), "b": (1, 4), "full": (2, 2), "none": (0, 0)}
    assert _least_other(rules, "me", workers) == (1, 4)  # b: 1/4 beats a: 1/2
    assert _least_other(rules, "me", {"me": (0, 4), "full": (2, 2)}) == (None, None)
    # ties take: equal ratios make both the least loaded
    assert rules.is_least(1, 4, 1, 4) and rules.is_least(1, 2, 2, 4)
    assert not rules.is_least(2, 4, 1, 4)
    assert rules.is_least(5, 6, None, None)  # nobody else has room


def _place_burst(rules, caps: dict[str, int], sessions: int, seed: int) -> dict[str, int]:
    """Placement rounds in a random order (Redis runs one script at a time), each taking
    one session at a time while its worker is the least loaded, as place.lua does, with
    no announcement old enough for a worker that is not."""
    rng = random.Random(seed)
    load = dict.fromkeys(caps, 0)
    never = _age(rules, "return -1")  # nothing has waited: age() must not make it take
    left, idle_rounds = sessions, 0
    while left:
        assert idle_rounds < 20 * len(caps), f"no worker takes the rest: {load}"
        idle_rounds += 1
        me = rng.choice(list(caps))
        best = _least_other(rules, me, {w: (load[w], caps[w]) for w in caps})
        while left and load[me] < caps[me]:
            first = rules.is_least(load[me], caps[me], *best)
            if not rules.takes_new(first, never, 1000):
                break
            load[me] += 1
            left, idle_rounds = left - 1, 0
    return load


@given(caps=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 10**6),
       share=st.floats(0, 1))
@RULE_EXAMPLES
def test_a_burst_spreads_by_load_whatever_the_order_of_rounds(rules, caps, seed, share):
    workers = {f"w{i}": c for i, c in enumerate(caps)}
    sessions = int(share * sum(caps))
    load = _place_burst(rules, workers, sessions, seed)
    assert sum(load.values()) == sessions and all(load[w] <= workers[w] for w in workers)
    if len(set(caps)) == 1:  # equal workers differ by one session at most
        assert max(load.values()) - min(load.values()) <= 1
    # no worker took while another with room was less loaded than it was before taking
    ratios = [(load[w] - 1) / workers[w] for w in workers if load[w]]
    room = [load[w] / workers[w] for w in workers if load[w] < workers[w]]
    assert not ratios or not room or max(ratios) <= min(room)


def test_a_worker_that_is_not_the_least_loaded_takes_only_what_waited(rules):
    unasked = _age(rules, "error('the least loaded worker must not look at the wait')")
    assert rules.takes_new(True, unasked, 1000)
    with pytest.raises(lua51.LuaError, match="must not look"):
        rules.takes_new(False, unasked, 1000)
    assert rules.takes_new(False, _age(rules, "return 1000"), 1000)
    assert not rules.takes_new(False, _age(rules, "return 999"), 1000)
    assert not rules.takes_new(False, _age(rules, "return nil"), 1000)  # the group is gone
    assert rules.orphan_idle_ms(3000, 1000, True) == 3000
    assert rules.orphan_idle_ms(3000, 1000, False) == 4000
    assert rules.nothing_to_place(0, -1)
    assert not rules.nothing_to_place(0, 0) and not rules.nothing_to_place(3000, -1)


# ---- Whisper's encoder window ------------------------------------------------------------


def test_a_final_gets_the_smallest_window_that_holds_it_never_below_the_floor():
    from cosyvoice.asr.whisper_engine import FULL_WINDOW_S, window_s
    assert window_s(3.0, 10) == 10
    assert window_s(9.5, 10) == 12  # 9.5 s + the 1 s margin
    assert window_s(13.9, 10) == 15
    assert window_s(28.5, 10) == FULL_WINDOW_S
    assert window_s(3.0, 8) == 8  # a floor outside the fixed sizes is a size of its own
    assert window_s(3.0, 0) == FULL_WINDOW_S  # 0: always the full window
    assert window_s(40.0, 10) == FULL_WINDOW_S


def test_a_short_window_caps_the_tokens_and_flags_degenerate_text():
    from cosyvoice.asr.whisper_engine import degenerate, token_cap
    assert token_cap(3.0) == 40
    assert not degenerate(1.3, 12, token_cap(3.0))
    assert degenerate(2.5, 12, token_cap(3.0))  # repetition compresses too well
    assert degenerate(1.3, 40, token_cap(3.0))  # ran to its cap


# ---- client send window ---------------------------------------------------------------------


def test_the_window_paces_real_time_and_caps_what_is_in_flight():
    w = SendWindow()
    w.start(0)
    assert w.wait(10, now=100.0, start=100.0, realtime=True) <= 0
    assert w.take() == 0
    assert w.wait(10, now=100.0, start=100.0, realtime=True) == pytest.approx(0.2)
    assert w.wait(10, now=100.0, start=100.0, realtime=False) <= 0  # --pace fast
    for _ in range(MAX_IN_FLIGHT):
        w.take()
    assert w.wait(10_000, now=200.0, start=100.0, realtime=False) == 0.05  # none acked
    w.ack(MAX_IN_FLIGHT - 1)
    assert w.wait(10_000, now=200.0, start=100.0, realtime=False) <= 0


def test_a_window_that_follows_switches_keeps_a_second_beyond_the_round_trip():
    w = SendWindow(limit=ABR_IN_FLIGHT)
    w.start(0)
    for _ in range(ABR_IN_FLIGHT + 1):
        w.take()
    assert w.wait(100, now=1.0, start=0.0, realtime=False) == 0.05  # five in flight
    # a 2 s round trip holds ten chunks on the path: fifteen may fly
    w.ack(0, rtt_s=2.0)
    assert w.in_flight == ABR_IN_FLIGHT + 10
    for _ in range(9):
        assert w.wait(100, now=3.0, start=0.0, realtime=False) <= 0
        w.take()
    assert w.next - w.acked - 1 == 15 - 1
    assert w.wait(100, now=3.0, start=0.0, realtime=False) <= 0
    w.take()
    assert w.wait(100, now=3.0, start=0.0, realtime=False) == 0.05
    w.ack(1, rtt_s=3.5)  # a queue: the shortest round trip seen still counts
    assert w.in_flight == ABR_IN_FLIGHT + 10


def test_until_the_first_ack_the_handshake_stands_in_for_the_round_trip():
    # a 2 s round trip: the handshake took two of them; the first ack's round trip then rules
    w = SendWindow(limit=ABR_IN_FLIGHT, handshake_s=4.1)
    w.start(0)
    assert w.in_flight == ABR_IN_FLIGHT + 20
    for seq in range(10):  # the first round trip's chunks go as they are captured
        assert w.wait(100, now=seq * 0.2, start=0.0, realtime=True) <= 0
        assert w.take() == seq
    w.ack(0, rtt_s=2.0)
    assert w.in_flight == ABR_IN_FLIGHT + 10
    assert SendWindow(limit=ABR_IN_FLIGHT).in_flight == ABR_IN_FLIGHT  # neither known
    # the client times its connect() to the session event; a reconnect's session keeps it
    client = StreamingClient("http://127.0.0.1:9", abr=True)
    client._connect_started = time.monotonic() - 4.1
    on = _handlers(client)
    on["session"]({"session": "s1", "resumed": False, "next_seq": 0, "sample_rate": 16000,
                   "abr": True, "codec": "pcm16"})
    assert client.window.handshake_s is not None and client.window.handshake_s >= 4.1
    assert client.window.in_flight == ABR_IN_FLIGHT + 20
    on["session"]({"session": "s1", "resumed": True, "next_seq": 3, "sample_rate": 16000,
                   "abr": True, "codec": "pcm16"})
    assert client.window.handshake_s >= 4.1


def test_the_window_rewinds_pauses_and_resumes_where_the_server_says():
    w = SendWindow()
    for _ in range(5):
        w.take()
    w.ack(1)
    w.rewind(2, now=50.0, pause_s=0.5)  # rate_limited at seq 2
    assert w.next == 2 and w.wait(10, now=50.1, start=0.0, realtime=False) == pytest.approx(0.4)
    w.rewind(4, now=50.0)  # a later rewind never skips ahead
    assert w.next == 2
    w.start(3)  # resumed: the server has 0-2
    assert (w.next, w.acked, w.done(4)) == (3, 2, False)
    assert w.take() == 3
    assert w.wait(4, now=60.0, start=0.0, realtime=False) == 0.2  # all sent: wait for acks
    w.ack(3)
    assert w.done(4)


# ---- client handlers on several threads -------------------------------------------------------


def _handlers(client: StreamingClient) -> dict:
    return client.sio.handlers[NAMESPACE]


def test_the_client_keeps_one_consistent_state_when_events_race_on_threads():
    client = StreamingClient("http://127.0.0.1:9")
    on = _handlers(client)
    on["session"]({"session": "s1", "resumed": False, "next_seq": 0, "sample_rate": 16000})
    finals = [{"type": "final", "utterance": u % 20, "text": f"w{u % 20}", "id": f"{u}-0",
               "seq": u, "start": 0, "end": 1} for u in range(200)]
    partials = [{"type": "partial", "utterance": 99, "text": "p", "id": f"{u}-1", "seq": u}
                for u in range(200)]
    errors = [{"code": "rate_limited", "msg": "slow down", "seq": s} for s in range(50, 0, -1)]
    barrier = threading.Barrier(4)

    def run(events, handler):
        barrier.wait()
        for e in events:
            on[handler](e)

    threads = [threading.Thread(target=run, args=args) for args in
               ((finals[::-1], "text"), (partials, "text"), (errors, "error"),
                (finals, "text"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    # every utterance's final once, whatever the order; every partial; every error
    assert sorted(f["utterance"] for f in client.result.finals) == list(range(20))
    assert len(client.result.partials) == 200 and len(client.result.errors) == 50
    assert client.window.next == 0  # rewound to the lowest seq asked for
    assert len(client.result.events) == 20 + 200 + 50 + 1
    # an end that overtakes the last final: the stream ends, the late final still counts
    on["end"]({"session": "s1", "id": "900-0"})
    on["text"]({"type": "final", "utterance": 20, "text": "late", "id": "899-0", "seq": 9,
                "start": 0, "end": 1})
    assert client.result.ended and client.result.finals[-1]["text"] == "late"
    # a resume after the session expired starts the audio again in the new session
    on["session"]({"session": "s2", "resumed": False, "next_seq": 0, "sample_rate": 16000})
    assert client.result.session == "s2" and client.result.finals == []
    assert (client.window.next, client.window.acked) == (0, -1)

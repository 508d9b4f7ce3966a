"""Adaptive bitrate decisions (cosyvoice.abr) against a simulated bottleneck link.

The link is a fake on purpose: a deterministic model of an in-order bottleneck (TCP shows
congestion as delay, not loss) lets an hour of chunks run in well under a second.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from cosyvoice.wire.abr import RUNGS, Config, Decision, Rung, rung_for, rung_named, start_rung
from cosyvoice.wire.abr_estimator import BaseDelay, Estimator

pytestmark = [pytest.mark.fast, pytest.mark.unit]

CHUNK_S = 0.2
PCM16, OPUS32, OPUS24, OPUS16, OPUS12 = RUNGS
DEFAULTS = Config()
# Clocks with offsets of their own: only differences may matter.
SENT_EPOCH_MS = 1_700_000_000_000
ARRIVAL_EPOCH_S = 86_400.0


def steps(*changes: tuple[float, float]) -> Callable[[float], float]:
    """A piecewise-constant function of time: ((from_s, value), ...), the first from 0."""

    def at(t: float) -> float:
        value = changes[0][1]
        for since, new in changes:
            if t >= since:
                value = new
        return value

    return at


SHORT_PATH = steps((0, 0.150))


@dataclass
class Trace:
    """What a simulated connection did, per chunk in arrival order (times from 0)."""

    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    # The estimator's target rung after each chunk.
    rungs: list[str] = field(default_factory=list)
    max_buckets: int = 0

    def when(self, direction: str) -> list[float]:
        return [t for t, d in self.decisions if d.direction == direction]

    def first_arrival_after(self, t: float) -> int:
        return next(i for i, a in enumerate(self.arrivals) if a >= t)


def simulate(
    duration_s: float,
    capacity_bps: Callable[[float], float],
    *,
    start: Rung = PCM16,
    propagation_s: Callable[[float], float] = SHORT_PATH,
    jitter_s: float = 0.050,
    seed: int = 1,
) -> tuple[Trace, Estimator]:
    """One client streaming 200 ms chunks through an in-order bottleneck.

    The bottleneck serves chunks one after another at ``capacity_bps``; each then takes the
    propagation delay plus uniform jitter, never overtaking the one before. The client sends
    at the rung it was last told, a round trip after the decision; chunks already sent keep
    their old rung.
    """
    rng = random.Random(seed)
    estimator = Estimator(start)
    trace = Trace()
    client = start
    pending: deque[tuple[float, Rung]] = deque()
    link_free = 0.0
    last_arrival = 0.0
    for i in range(round(duration_s / CHUNK_S)):
        sent = i * CHUNK_S
        while pending and pending[0][0] <= sent:
            client = pending.popleft()[1]
        nbytes = round(client.wire_bps * CHUNK_S / 8)
        begin = max(sent, link_free)
        link_free = begin + nbytes * 8 / capacity_bps(begin)
        delay = propagation_s(link_free) + rng.uniform(-jitter_s, jitter_s)
        last_arrival = max(last_arrival, link_free + delay)
        decision = estimator.on_chunk(
            SENT_EPOCH_MS + round(sent * 1000), ARRIVAL_EPOCH_S + last_arrival, nbytes,
            client.name,
        )
        if decision is not None:
            trace.decisions.append((last_arrival, decision))
            pending.append((last_arrival + 2 * propagation_s(last_arrival), decision.rung))
        trace.arrivals.append(last_arrival)
        trace.queue_ms.append(estimator.queue_delay_ms)
        trace.rungs.append(estimator.rung.name)
        trace.max_buckets = max(trace.max_buckets, estimator.base_buckets)
    return trace, estimator


def stays(trace: Trace, rung: str) -> list[float]:
    """Durations of the stretches the estimator targeted ``rung``."""
    spans, since = [], None
    for t, name in zip(trace.arrivals, trace.rungs, strict=True):
        if name == rung and since is None:
            since = t
        elif name != rung and since is not None:
            spans.append(t - since)
            since = None
    if since is not None:
        spans.append(trace.arrivals[-1] - since)
    return spans


MAX_BUCKETS = math.ceil(DEFAULTS.base_window_s / DEFAULTS.base_bucket_s) + 1


# ---- whole connections ------------------------------------------------------------------


def test_an_hour_on_a_clean_jittery_link_changes_nothing():
    trace, estimator = simulate(3600, steps((0, 1e6)))
    assert trace.decisions == []
    assert max(trace.queue_ms) < DEFAULTS.high_delay_ms
    assert estimator.rung == PCM16
    assert trace.max_buckets <= MAX_BUCKETS


def test_a_capacity_drop_switches_down_fast_and_recovery_probes_back_up():
    trace, _ = simulate(400, steps((0, 1e6), (60, 200e3), (120, 1e6)))
    t_down, down = trace.decisions[0]
    assert down.direction == "down" and down.reason == "congestion"
    assert 60 < t_down <= 65
    assert down.rung.codec == "opus" and down.rung.wire_bps <= DEFAULTS.headroom * 200e3
    # The backlog drains at the new rung within a few seconds.
    after = trace.first_arrival_after(t_down)
    drained = next(i for i in range(after, len(trace.arrivals))
                   if trace.queue_ms[i] < DEFAULTS.low_delay_ms)
    assert trace.arrivals[drained] - t_down < 10
    assert trace.rungs[trace.first_arrival_after(119)] != "pcm16"
    # Back at 1 Mbit/s: a probe returns to pcm16 and holds.
    ups = [(t, d) for t, d in trace.decisions if d.direction == "up" and t >= 120]
    assert ups and ups[-1][1].rung == PCM16 and ups[-1][0] <= 120 + 180
    assert all(d.direction == "up" for t, d in trace.decisions if t > ups[-1][0])
    assert trace.rungs[-1] == "pcm16"


def test_a_deep_drop_goes_straight_to_the_rung_the_delivery_rate_fits():
    trace, estimator = simulate(120, steps((0, 1e6), (60, 30e3)))
    t_down, down = trace.decisions[0]
    assert down.rung == OPUS16 and t_down < 60 + 8
    assert estimator.delivery_bps is not None
    assert estimator.delivery_bps == pytest.approx(30e3, rel=0.15)


def test_a_link_too_slow_for_pcm16_backs_off_its_probes():
    """150 kbit/s: every opus rung fits, pcm16 (270 kbit/s) never does. The estimator goes
    down within seconds, then probes pcm16 a few times an hour, waiting longer after each
    failure, and never sits on pcm16 for more than the seconds a probe takes to fail."""
    trace, estimator = simulate(1800, steps((0, 150e3)))
    t_down, down = trace.decisions[0]
    assert t_down < 3 and down.rung == OPUS32
    probes = trace.when("up")
    assert 2 <= len(probes) <= 6
    outcomes = [d.reason for _, d in trace.decisions[1:] if d.direction == "down"]
    assert outcomes == ["probe_failed"] * len(probes)
    gaps = [later - earlier for earlier, later in zip(probes, probes[1:], strict=False)]
    assert all(later > earlier for earlier, later in zip(gaps, gaps[1:], strict=False))
    assert gaps[-1] > 4 * gaps[0]
    assert max(stays(trace, "pcm16")) < 5
    assert estimator.probe_wait_s == DEFAULTS.probe_wait_max_s
    # Outside those seconds the queue is empty.
    settled = trace.first_arrival_after(10)
    high = sum(q > DEFAULTS.high_delay_ms for q in trace.queue_ms[settled:])
    assert high / len(trace.queue_ms[settled:]) < 0.02


def test_64_kbits_settles_on_opus32():
    """64 kbit/s fits every opus rung with headroom (opus32 needs 38 of the 48 kbit/s it may
    use): the estimator settles on opus32, never lower. Its rare probes to pcm16 fail; each
    leaves a backlog of pcm16 chunks that drains at opus32 without a further step down."""
    trace, estimator = simulate(1800, steps((0, 64e3)))
    assert trace.decisions[0][1].rung == OPUS32 and trace.decisions[0][0] < 4
    assert {d.rung for _, d in trace.decisions} <= {OPUS32, PCM16}
    settled = trace.first_arrival_after(60)
    on_opus32 = trace.rungs[settled:].count("opus32") / len(trace.rungs[settled:])
    assert on_opus32 > 0.97
    assert estimator.rung == OPUS32
    calm = sorted(trace.queue_ms[settled:])[len(trace.queue_ms[settled:]) // 2]
    assert calm < DEFAULTS.low_delay_ms


def test_a_wrong_first_guess_steps_down_again_once_the_new_rung_grows():
    """25 kbit/s under opus32: the queue is detected before a delivery rate spans a second,
    so the first step is one rung down, to opus24, which does not fit either. Its own
    chunks show the queue still growing, so after the freeze it steps to the rung that fits
    three quarters of the delivery rate measured meanwhile: opus12 (18 kbit/s on the wire)."""
    trace, _ = simulate(120, steps((0, 1e6), (10, 25e3)), start=OPUS32)
    assert [(d.rung, d.reason) for _, d in trace.decisions] == [
        (OPUS24, "congestion"), (OPUS12, "congestion")
    ]
    (first, _), (second, _) = trace.decisions
    assert first < 12 and first + DEFAULTS.freeze_timeout_s <= second < first + 15


def test_a_probe_that_dies_late_still_backs_off():
    """268 kbit/s: pcm16 almost fits, so a probe's queue takes longer than probe_check_s to
    rise. That is reported as congestion, and the wait still doubles."""
    trace, estimator = simulate(1800, steps((0, 268e3)))
    probes = trace.when("up")
    assert 2 <= len(probes) <= 6
    assert {d.reason for _, d in trace.decisions if d.direction == "down"} == {"congestion"}
    assert estimator.probe_wait_s == DEFAULTS.probe_wait_max_s
    assert max(trace.queue_ms) < 2 * DEFAULTS.high_delay_ms


def test_a_probe_that_survives_resets_the_wait():
    trace, estimator = simulate(900, steps((0, 150e3), (400, 1e6)))
    t_up, up = trace.decisions[-1]
    assert up.rung == PCM16 and t_up > 400
    assert estimator.rung == PCM16 and estimator.probe_wait_s == DEFAULTS.probe_wait_s


def test_a_longer_route_reads_as_congestion_until_the_base_ages_out():
    """The path grows from 150 to 550 ms for good at t=300 s. The 10-minute base still holds
    the short path, so the extra 400 ms reads as a standing queue: one switch down. The new
    rung's queue does not grow, so it never steps down again; once the old minima age out of
    the base window the queue reads empty, and a probe returns to pcm16 for good."""
    trace, estimator = simulate(
        1800, steps((0, 1e6)), propagation_s=steps((0, 0.150), (300, 0.550))
    )
    assert [(d.direction, d.rung) for _, d in trace.decisions] == [
        ("down", OPUS32), ("up", PCM16)
    ]
    (t_down, _), (t_up, _) = trace.decisions
    assert 300 < t_down < 305
    aged_out = 300 + DEFAULTS.base_window_s + DEFAULTS.base_bucket_s
    assert aged_out - DEFAULTS.base_bucket_s < t_up < aged_out + 120
    assert estimator.rung == PCM16
    assert max(trace.queue_ms[trace.first_arrival_after(t_up + 5):]) < DEFAULTS.high_delay_ms
    assert trace.max_buckets <= MAX_BUCKETS


def test_a_shorter_route_is_adopted_at_once():
    trace, _ = simulate(600, steps((0, 1e6)), propagation_s=steps((0, 0.400), (200, 0.100)))
    assert trace.decisions == []


def test_base_history_stays_bounded_and_forgets_after_its_window():
    base = BaseDelay(window_s=600, bucket_s=10)
    for t in range(10 * 3600):
        base.add(t, 50.0 if t < 100 else 500.0)
        assert len(base) <= 61
    assert base.add(10 * 3600, 500.0) == 500.0
    fresh = BaseDelay(window_s=600, bucket_s=10)
    fresh.add(0.0, 50.0)
    assert fresh.add(599.0, 500.0) == 50.0
    assert fresh.add(611.0, 500.0) == 500.0


# ---- start rung -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (None, (PCM16, "default")),
        ({}, (PCM16, "default")),
        ({"effective_type": "4g"}, (PCM16, "network_hint")),
        ({"effective_type": "3G "}, (OPUS32, "network_hint")),
        ({"effective_type": "2g"}, (OPUS12, "network_hint")),
        ({"effective_type": "slow-2g", "downlink_mbps": 10}, (OPUS12, "network_hint")),
        ({"downlink_mbps": 10}, (PCM16, "network_hint")),
        ({"downlink_mbps": 0.6}, (PCM16, "network_hint")),
        ({"downlink_mbps": 0.4}, (OPUS32, "network_hint")),
        ({"downlink_mbps": 0.065}, (OPUS24, "network_hint")),
        ({"downlink_mbps": 0.01}, (OPUS12, "network_hint")),
        ({"effective_type": "4g", "downlink_mbps": 0.3, "rtt_ms": 50}, (OPUS32, "network_hint")),
        ({"effective_type": "3g", "downlink_mbps": 0.05}, (OPUS16, "network_hint")),
        ({"downlink_mbps": 1e308}, (PCM16, "network_hint")),
    ],
)
def test_start_rung_follows_the_network_hint(hint, expected):
    assert start_rung(hint) == expected


@pytest.mark.parametrize(
    "hint",
    [
        "4g", ["3g"], 42,
        {"effective_type": "5g"}, {"effective_type": None}, {"effective_type": 3},
        {"downlink_mbps": "fast"}, {"downlink_mbps": float("nan")},
        {"downlink_mbps": float("inf")}, {"downlink_mbps": -1}, {"downlink_mbps": 0},
        {"downlink_mbps": True}, {"downlink_mbps": None}, {"rtt_ms": "x"}, {"rtt_ms": 2000},
    ],
)
def test_start_rung_ignores_junk_hints(hint):
    assert start_rung(hint) == (PCM16, "default")


def test_start_rung_without_opus_rungs_falls_to_the_lowest():
    rungs = (PCM16, Rung("pcm8", "pcm16", 128_000, 8000, 140_000))
    assert start_rung({"effective_type": "2g"}, rungs) == (rungs[1], "network_hint")


# ---- rungs ------------------------------------------------------------------------------


def test_rungs_are_ordered_and_look_up_by_name_and_encoding():
    assert [r.wire_bps for r in RUNGS] == sorted((r.wire_bps for r in RUNGS), reverse=True)
    assert rung_named("opus24") == OPUS24
    with pytest.raises(KeyError):
        rung_named("mp3")
    assert rung_for("opus", 30_000) == OPUS32
    assert rung_for("opus", 17_000) == OPUS16
    assert rung_for("pcm16", 256_000) == PCM16
    assert rung_for("opus", float("nan")) == OPUS32
    assert rung_for("flac", 1) is None
    assert OPUS16.to_wire() == {"codec": "opus", "bitrate": 16_000, "sample_rate": 16_000}


# ---- edges ------------------------------------------------------------------------------


def feed(estimator: Estimator, delays_ms: list[float], rung: Rung, start_s: float = 0.0,
         sent_start_ms: int = 0) -> list[Decision]:
    """Chunks sent every 200 ms with the given one-way delays; the decisions returned."""
    decisions = []
    nbytes = round(rung.wire_bps * CHUNK_S / 8)
    for i, delay in enumerate(delays_ms):
        sent_ms = sent_start_ms + i * 200
        arrival = start_s + (sent_ms + delay) / 1000
        decision = estimator.on_chunk(sent_ms, arrival, nbytes, rung.name)
        if decision is not None:
            decisions.append(decision)
    return decisions


def test_single_late_chunks_never_switch():
    estimator = Estimator(PCM16)
    delays = [150.0] * 50
    for i in (10, 20, 21, 35, 36):
        delays[i] = 2000.0
    assert feed(estimator, delays, PCM16) == []
    assert feed(Estimator(PCM16), [150.0] * 10 + [900.0] * 3, PCM16)[0].rung == OPUS32


def burst_then_paced(estimator: Estimator, rung: Rung, link_bps: float,
                     paced_delay_ms: float) -> list[Decision]:
    """Ten chunks at their pace (150 ms path), a 2 s stall (late acks), then the ten that
    waited sent at one instant through a ``link_bps`` bottleneck, then chunks at their pace
    again with ``paced_delay_ms`` of one-way delay; the decisions returned."""
    decisions, nbytes = [], round(rung.wire_bps * CHUNK_S / 8)
    chunks = [(i * 200, i * 200 + 150.0) for i in range(10)]
    link_free = 4000.0
    for _ in range(10):  # sent together at 4 s, served one after another
        link_free += nbytes * 8 / link_bps * 1000
        chunks.append((4000, link_free + 150.0))
    chunks += [(4200 + i * 200, 4200 + i * 200 + paced_delay_ms) for i in range(10)]
    for sent_ms, arrival_ms in chunks:
        decision = estimator.on_chunk(sent_ms, arrival_ms / 1000, nbytes, rung.name)
        if decision is not None:
            decisions.append(decision)
    return decisions


def test_a_burst_after_a_stall_queues_behind_itself_and_switches_nothing():
    # Opus 32 kbit/s through 64 kbit/s: the tenth chunk of the burst waits 0.6 s
    assert burst_then_paced(Estimator(OPUS32), OPUS32, 64e3, 150.0) == []
    # the same burst, and the queue still stands while chunks go at their pace: congestion
    [down] = burst_then_paced(Estimator(OPUS32), OPUS32, 64e3, 1500.0)
    assert (down.direction, down.reason, down.rung) == ("down", "congestion", OPUS24)


def test_congestion_at_the_lowest_rung_reports_nothing():
    estimator = Estimator(OPUS12)
    assert feed(estimator, [150.0] * 5 + [150.0 + 200 * i for i in range(200)], OPUS12) == []
    assert estimator.rung == OPUS12 and estimator.queue_delay_ms > 10_000


def test_junk_stamps_and_sizes_never_raise():
    estimator = Estimator(OPUS32)
    for sent, arrival, nbytes in [
        (float("nan"), 1.0, 900), (0, float("inf"), 900), (0, 1.0, 0), (200, 1.2, -5),
        (400, 1.4, float("nan")), (600, float("-inf"), 900),
    ]:
        assert estimator.on_chunk(sent, arrival, nbytes, "opus32") is None  # type: ignore[arg-type]
    assert estimator.queue_delay_ms == 0.0 and estimator.delivery_bps is None


def test_out_of_order_and_restarted_client_clocks_never_switch():
    estimator = Estimator(PCM16)
    assert feed(estimator, [150.0] * 20, PCM16, sent_start_ms=10_000) == []
    # A chunk stamped 300 ms early is ignored, not read as 300 ms of extra delay.
    assert estimator.on_chunk(13_500, 14.15, 6750, "pcm16") is None
    # The client's clock restarts at 0 an hour in: the delay history starts over.
    assert feed(estimator, [150.0] * 20, PCM16, start_s=14.0, sent_start_ms=0) == []
    assert estimator.queue_delay_ms < DEFAULTS.low_delay_ms
    # And jumps forward a day: a lower delay, adopted as the base at once.
    assert feed(estimator, [150.0] * 20, PCM16, start_s=-86_400 + 19,
                sent_start_ms=86_400_000) == []
    assert estimator.queue_delay_ms < DEFAULTS.low_delay_ms


def test_a_gateway_clock_stepping_back_restarts_without_a_decision():
    estimator = Estimator(PCM16)
    assert feed(estimator, [150.0] * 20, PCM16, start_s=1000.0) == []
    assert feed(estimator, [150.0] * 20, PCM16, start_s=0.0, sent_start_ms=4000) == []
    assert estimator.rung == PCM16 and estimator.queue_delay_ms < DEFAULTS.low_delay_ms


def test_a_client_that_ignores_a_switch_gets_no_more_decisions():
    estimator = Estimator(PCM16)
    growing = [150.0] * 10 + [150.0 + 100 * i for i in range(1, 300)]
    decisions = feed(estimator, growing, PCM16)
    assert [d.rung for d in decisions] == [OPUS32]


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        Config(low_delay_ms=400, high_delay_ms=300)
    with pytest.raises(ValueError):
        Config(debounce_chunks=0)
    with pytest.raises(ValueError):
        Config(headroom=1.5)
    with pytest.raises(ValueError):
        Config(base_bucket_s=0)
    with pytest.raises(ValueError):
        Estimator(Rung("mp3", "mp3", 1, 1, 1))

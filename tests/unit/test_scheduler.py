"""The decode scheduler (cosyvoice/asr/scheduler.py): finals first, partials coalesced and
batched, and nothing about a session's finals changed by what else is decoded beside it.

The first tests drive the scheduler's thread with decode functions of their own that
record what they are asked and wait on a gate, so a test can line work up while the
thread is busy; the rest decode real speech with Whisper tiny.en.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from cosyvoice.asr import live_engine
from cosyvoice.asr.scheduler import DecodeJob, DecodeScheduler, StreamState
from cosyvoice.asr.tiny_whisper import Decoded
from cosyvoice.settings import Settings
from cosyvoice.wire.messages import Checkpoint, End, Published, Result, Scheduled
from cosyvoice.worker.outbox import Pending

from ..helpers import finals, read_pcm, run_stream

pytestmark = pytest.mark.unit

WAIT_S = 10.0


class Recorder:
    """Decode functions that log each call; partial batches wait for ``gate``."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def final(self, job: DecodeJob):
        self.calls.append(("final", job.result["name"], job.prompt))
        return Decoded(job.result["name"])

    def prepare(self, job: DecodeJob):
        window = job.result.get("window", 10.0)
        return SimpleNamespace(window=window, group=("tiny.en", window))

    def partials(self, jobs: list[DecodeJob], between):
        self.started.set()
        assert self.gate.wait(WAIT_S)
        between()  # after the first step of the batch
        self.calls.append(("partials", [j.result["name"] for j in jobs],
                           [j.prompt for j in jobs]))
        return [Decoded(j.result["name"]) for j in jobs]


def finish_final(job: DecodeJob, decoded) -> None:
    job.state.prompt = f"{job.state.prompt} {decoded.text}".strip()
    job.state.utterance += 1
    job.after = {"prompt": job.state.prompt}


def finish_partial(job: DecodeJob, decoded) -> None:
    job.result["text"] = decoded.text


def job(kind: str, state: StreamState, name: str, **extra) -> DecodeJob:
    return DecodeJob(kind, state, b"", {"name": name, **extra},
                     finish_final if kind == "final" else finish_partial)


def wait_done(jobs, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(j.done for j in jobs):
        assert time.monotonic() < deadline, "the scheduler did not finish its jobs"
        time.sleep(0.005)


@pytest.mark.fast
def test_finals_go_first_and_a_sessions_partials_coalesce():
    rec = Recorder()
    sched = DecodeScheduler(rec.final, rec.prepare, rec.partials, max_batch=2)
    a, b, c, d = (StreamState() for _ in range(4))
    try:
        first = job("partial", a, "a1")
        sched.submit(first)
        assert rec.started.wait(WAIT_S)  # the thread is in a1's batch now
        b1, b2 = job("partial", b, "b1"), job("partial", b, "b2")
        d1 = job("partial", d, "d1")
        c_final = job("final", c, "C")
        c2 = job("partial", c, "c2")  # its session's final is being decoded: waits for it
        d_final = job("final", d, "D")  # ends d's utterance: d1 is dropped
        for j in (b1, b2, d1, c_final, c2, d_final):
            sched.submit(j)
        assert b1.dropped and b1.done  # replaced by b2, never decoded
        assert d1.dropped and d1.done
        rec.gate.set()
        wait_done([first, b2, c_final, c2, d_final])
        assert sched.wait_idle(WAIT_S)
    finally:
        sched.stop()
    # Both finals were decoded between the first step of a1's batch and its end; then the
    # waiting partials, at most two a batch, c2 with the prompt its final left.
    assert rec.calls[0] == ("final", "C", "")
    assert rec.calls[1] == ("final", "D", "")
    assert rec.calls[2] == ("partials", ["a1"], [""])
    batched = [name for call in rec.calls[3:] for name in call[1]]
    assert sorted(batched) == ["b2", "c2"]
    assert all(len(call[1]) <= 2 for call in rec.calls[3:])
    assert c2.prompt == "C" and c2.result["text"] == "c2"
    assert c_final.after == {"prompt": "C"}
    assert (sched.finals_decoded, sched.partials_decoded, sched.partials_dropped) == (2, 3, 2)


@pytest.mark.fast
def test_a_batch_shares_one_encoder_window_and_a_cancelled_session_is_not_decoded():
    rec = Recorder()
    rec.gate.set()
    sched = DecodeScheduler(rec.final, rec.prepare, rec.partials, max_batch=8)
    states = [StreamState() for _ in range(4)]
    gone = StreamState()
    try:
        with sched._cond:  # line the work up before the thread can take any of it
            jobs = [job("partial", st, f"p{i}", window=10.0 if i % 2 else 15.0)
                    for i, st in enumerate(states)]
            for j in jobs:
                sched.submit(j)
            lost = job("partial", gone, "lost")
            sched.submit(lost)
            sched.cancel(gone)
            gone_final = job("final", gone, "gone")
            sched.submit(gone_final)
        wait_done([*jobs, lost, gone_final])
    finally:
        sched.stop()
    assert lost.dropped and gone_final.dropped
    assert ("final", "gone", "") not in rec.calls
    batches = sorted(sorted(call[1]) for call in rec.calls)
    assert batches == [["p0", "p2"], ["p1", "p3"]]


@pytest.mark.fast
def test_pending_publishes_a_scheduled_result_as_decoded_and_skips_a_dropped_one():
    st = StreamState()
    kept, gone = job("partial", st, "kept"), job("partial", st, "gone")
    kept.finish(kept, Decoded("hello"))
    kept.done = True
    gone.drop()
    final = job("final", st, "F")
    final.finish(final, Decoded("F"))
    final.done = True
    def placeholder(kind) -> Result:
        return {"type": kind, "text": "", "utterance": 0, "start": 0.0, "end": 1.0, "seq": 3}
    end: End = {"type": "end", "session": "s", "seq": 3}
    results: list[Result | Scheduled | End] = [
        Scheduled(placeholder("partial"), kept), Scheduled(placeholder("partial"), gone),
        Scheduled(placeholder("final"), final), end]
    item = Pending("1-0", results, Checkpoint("1-0", 3, {"offset": 0, "prompt": "old"}), True)
    assert item.jobs == [kept, gone, final]
    assert item.ready() and not item.failed()
    out = item.publishable()
    assert [r["type"] for r in out] == ["partial", "final", "end"]
    assert out[0]["text"] == "hello" and out[0]["seq"] == 3  # type: ignore[typeddict-item]
    assert item.final_checkpoint() == Checkpoint("1-0", 3, {"offset": 0, "prompt": "F"})


# ---- real speech ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    return live_engine.LiveModel(Settings()).decoder


# English partials are decoded without a prompt (the service's way), other languages' with
# the session's: both, each clip in a batch against the same clip alone. Under this prompt
# tiny.en loops on "call" ("Please call me back in the morning." over and over) and stops
# at a near tie between the end of text and another round, which the batch's float
# arithmetic can break the other way on some CPUs (seen on an AVX-512 host): a looping
# decode is no clip to compare on.
@pytest.mark.parametrize("prompt, names", [
    ("", ["birch", "call", "chicken", "coffee"]),
    ("The meeting starts at ten.", ["birch", "chicken", "coffee", "door"]),
])
def test_a_batch_of_partials_decodes_each_clip_as_it_would_alone(decoder, prompt, names):
    floor = Settings().live_partial_window_s
    clips = [decoder.clip(read_pcm(n), floor) for n in names]
    steps: list[int] = []
    batch = decoder.decode_partials(clips, [prompt] * len(clips), lambda: steps.append(1))
    alone = [decoder.decode(read_pcm(n), prompt, beam_size=1,
                            floor_s=floor, fallback=False)
             for n in names]
    assert [d.text for d in batch] == [d.text for d in alone]
    assert [d.tokens for d in batch] == [d.tokens for d in alone]
    assert all(d.text for d in batch)
    assert len(steps) == len(names)  # a final may be decoded after each clip's encoder pass


def scheduled_run(model, pcms: list[bytes], chunk: int = 6400) -> list[list[Published]]:
    """Stream several sessions at once, chunk by chunk in turn, through ``model``'s
    scheduler; each session's published results, as the worker would publish them."""
    streams = [model.stream(16000) for _ in pcms]
    items: list[list[Pending]] = [[] for _ in pcms]
    flushed = [False] * len(pcms)
    longest = max(len(p) for p in pcms)
    for pos in range(0, longest + chunk, chunk):
        for i, (stream, pcm) in enumerate(zip(streams, pcms, strict=True)):
            if flushed[i]:
                continue
            if pos < len(pcm):
                out = stream.feed(pcm[pos:pos + chunk])
            else:
                out, flushed[i] = stream.flush(), True
            items[i].append(Pending(str(pos), list(out), None, False))
    all_jobs = [j for per in items for item in per for j in item.jobs]
    wait_done(all_jobs, 120.0)
    return [[r for item in per for r in item.publishable()] for per in items]


def test_sessions_decoded_together_get_the_finals_each_gets_alone():
    names = ["two_utterances", "shells", "meeting"]
    pcms = [read_pcm(n) for n in names]
    inline = live_engine.LiveModel(Settings())
    alone = [finals(run_stream(inline, pcm)[0]) for pcm in pcms]
    model = live_engine.LiveModel(Settings(), decoder=inline.decoder)
    sched = model.start_scheduler(4)
    try:
        together = scheduled_run(model, pcms)
    finally:
        sched.stop()
    for solo, shared in zip(alone, together, strict=True):
        assert [(f["text"], f["utterance"], f["words"]) for f in finals(shared)] == \
            [(f["text"], f["utterance"], f["words"]) for f in solo]
        assert solo  # every session said something
        # no partial after its utterance's final
        done = -1
        for r in shared:
            if r["type"] == "final":
                done = r["utterance"]
            elif r["type"] == "partial":
                assert r["utterance"] > done
    assert sched.finals_decoded == sum(len(f) for f in alone)



# ---- devices ----------------------------------------------------------------------------


@pytest.mark.fast
def test_the_device_and_compute_type_come_from_the_settings():
    from cosyvoice.asr.device import resolve_compute_type, resolve_device
    from cosyvoice.settings import SettingsError

    env = {"COSYVOICE_DEVICE": "cuda", "COSYVOICE_COMPUTE_TYPE": "float16"}
    s = Settings.from_env(env)
    assert (s.device, s.compute_type) == ("cuda", "float16")
    assert Settings().device == "auto" and Settings().compute_type == "auto"
    for bad in ({"COSYVOICE_DEVICE": "tpu"}, {"COSYVOICE_COMPUTE_TYPE": "int4"}):
        with pytest.raises(SettingsError):
            Settings.from_env(bad)
    assert resolve_device("cuda") == "cuda" and resolve_device("cpu") == "cpu"
    assert resolve_compute_type("auto", "cpu") == "int8"
    assert resolve_compute_type("auto", "cuda") == "int8_float16"
    assert resolve_compute_type("float16", "cuda") == "float16"


def test_auto_resolves_where_the_model_loads():
    import ctranslate2

    from cosyvoice.asr.device import resolve_compute_type

    # "auto": CUDA where CTranslate2 sees a GPU (int8_float16), else the CPU (int8)
    device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    model = live_engine.LiveModel(Settings())
    dec = model.decoder
    assert (dec.device, dec.compute_type) == ("auto", "auto")  # nothing imported yet
    dec.load()
    assert (dec.device, dec.compute_type) == (device, resolve_compute_type("auto", device))
    assert dec._wm.model.device == device
    assert dec._wm.model.compute_type.startswith("int8")  # CTranslate2: int8_float32 on a CPU


def test_the_torch_backend_takes_the_same_device_setting():
    import torch

    from cosyvoice.asr import model_data

    assert model_data.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert model_data.resolve_device("cpu") == "cpu"
    assert model_data.resolve_device("cuda") == "cuda"


# ---- admission that follows the scheduler (cosyvoice/asr/admission.py) ------------------


@pytest.mark.fast
def test_the_scheduler_reports_its_busy_time_and_each_decodes_wait():
    rec = Recorder()
    sched = DecodeScheduler(rec.final, rec.prepare, rec.partials, max_batch=4)
    a, b, c = (StreamState() for _ in range(3))
    try:
        sched.sample()  # from now on
        a1 = job("partial", a, "a1")
        sched.submit(a1)
        assert rec.started.wait(WAIT_S)  # a1's batch holds the thread until the gate opens
        b1 = job("partial", b, "b1")
        sched.submit(b1)
        time.sleep(0.1)
        b2 = job("partial", b, "b2")  # replaces b1: b has waited for a partial since b1
        c_final = job("final", c, "C")
        sched.submit(b2)
        sched.submit(c_final)
        time.sleep(0.2)
        rec.gate.set()
        wait_done([a1, b2, c_final])
        assert sched.wait_idle(WAIT_S)
        load = sched.sample()
        idle = sched.sample()
    finally:
        sched.stop()
    assert b2.submitted == b1.submitted
    assert len(load.final_waits) == 1 and load.final_waits[0] >= 0.2
    # the final's time from hand-over to text: its wait and its decode
    assert len(load.final_times) == 1 and load.final_times[0] >= load.final_waits[0]
    assert len(load.partial_waits) == 2  # a1 and b2; b1 was never decoded
    assert max(load.partial_waits) >= 0.3  # b: from b1's hand-over to b2's decode
    assert 0.5 <= load.busy <= 1.0  # the gate held the thread busy for most of the sample
    assert idle.final_waits == idle.partial_waits == idle.final_times == []
    assert idle.busy < 0.5


W = 10  # waits a sample: enough to judge (admission.MIN_WAITS)


def targets(final_s: float = 0.3, partial_s: float = 1.0, busy: float = 0.7,
            final_time_s: float | None = None):
    from cosyvoice.asr.admission import Targets
    return Targets(final_s, partial_s, busy, final_time_s)


@pytest.mark.fast
def test_admission_over_target_stops_admitting_and_sheds_nobody():
    from cosyvoice.asr.admission import MIN_WAITS, Admission
    assert W >= MIN_WAITS
    adm = Admission(start=6, ceiling=12, targets=targets())
    assert adm.update(4, 0.4, [0.1] * W, [0.5] * W) == 6  # within target: unchanged
    assert adm.update(6, 0.9, [0.5] * 2 * W, [0.5] * W) == 5  # finals over target
    assert adm.reason == "over target"
    assert adm.update(6, 0.9, [0.5] * W, []) == 5  # still over: holds, sheds nobody
    assert adm.update(5, 0.9, [0.5] * W, []) == 4  # a session ended: one less again
    two = Admission(start=6, ceiling=12, targets=targets())
    assert two.update(2, 0.5, [], [2.0] * W) == 1  # partials over target at two sessions
    # one session's decodes wait only behind each other: nothing to step down from
    one = Admission(start=6, ceiling=12, targets=targets())
    assert one.update(1, 0.5, [0.5] * W, [2.0] * W) == 6


@pytest.mark.fast
def test_admission_within_target_grows_one_at_a_time_to_the_measured_fit():
    from cosyvoice.asr.admission import Admission
    adm = Admission(start=6, ceiling=9, targets=targets(busy=0.7))
    # 6 sessions keep the scheduler busy 30 % of the time: 0.05 a session, 14 would fit
    seen = [adm.update(adm.capacity, 0.05 * adm.capacity, [0.1] * W, [0.4] * W)
            for _ in range(9)]
    # the cost is known after 5 samples; then one more a renewal while full, to the ceiling
    assert seen == [6, 6, 6, 6, 7, 8, 9, 9, 9]
    assert adm.update(3, 0.15, [0.1] * W, [0.4] * W) == 9  # not full: no reason to grow
    # the host slows down (0.2 a session): once that is most of the window, the fit is 3
    for _ in range(10):
        adm.update(3, 0.6, [0.1] * W, [0.4] * W)
    assert adm.capacity == 3 and adm.reason == "fit"
    # idle: keeps its capacity, forgets the waits of the sessions gone
    assert adm.update(0, 0.0, [], []) == 3 and not adm.finals and not adm.partials


@pytest.mark.fast
def test_a_capacity_starts_in_the_share_of_cores_other_work_leaves_and_grows_back():
    from cosyvoice.asr.admission import Admission, start_capacity
    assert start_capacity(6, 2, None) == 6  # nothing known: the engine's
    assert start_capacity(6, 2, 0.3) == 6  # noise
    assert start_capacity(6, 2, 1.0) == 3  # a core taken: half
    assert start_capacity(6, 4, 1.0) == 4  # three quarters of 6: 4.5 rounds to even
    assert start_capacity(6, 2, 2.0) == 1  # every core busy: still one session
    assert start_capacity(6, 2, 5.0) == 1
    # started low, it grows back to the measured fit while its sessions are within target
    adm = Admission(start=start_capacity(6, 2, 1.0), ceiling=12, targets=targets(busy=0.7))
    seen = [adm.update(adm.capacity, 0.05 * adm.capacity, [0.1] * W, [0.4] * W)
            for _ in range(8)]
    assert seen == [3, 3, 3, 3, 4, 5, 6, 7]


@pytest.mark.fast
def test_the_host_load_is_read_from_proc_stat_for_the_pools_cores_less_its_own_time():
    from cosyvoice.worker import hostload
    stat = ("cpu  400 0 200 1000 50 0 0 0 0 0\n"
            "cpu0 100 0 50 500 25 0 0 0 0 0\n"
            "cpu1 300 0 150 500 25 0 0 0 0 0\n"
            "intr 12345\n")
    assert hostload._cpu_ticks([0], stat) == (150, 675)
    assert hostload._cpu_ticks([0, 1], stat) == (600, 1650)
    now = hostload.sample()
    assert now is not None and now.total > 0  # this is Linux
    assert hostload.others(None, now) is None and hostload.others(now, now) is None
    # 2 cores: all busy for 1 s, of which this pool's processes took half a core
    ticks = hostload.os.sysconf("SC_CLK_TCK")
    n = len(hostload.cores())
    before = hostload.Sample(0.0, 0, 0, 0)
    after = hostload.Sample(1.0, n * ticks, n * ticks, ticks // 2)
    assert hostload.others(before, after) == n - 0.5


@pytest.mark.fast
def test_under_a_cpu_quota_the_host_load_is_not_known(tmp_path):
    from cosyvoice.worker import hostload
    v2 = tmp_path / "v2" / "pod"
    v2.mkdir(parents=True)
    (tmp_path / "v2.cgroup").write_text("0::/pod\n")
    quota = lambda root: hostload.quota(str(tmp_path / root), str(tmp_path / f"{root}.cgroup"))  # noqa: E731
    (v2 / "cpu.max").write_text("max 100000\n")
    assert not quota("v2")
    (v2 / "cpu.max").write_text("200000 100000\n")  # two cores' worth
    assert quota("v2")
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "docker" / "c1"
    v1.mkdir(parents=True)
    (tmp_path / "v1.cgroup").write_text("4:memory:/docker/c1\n2:cpu,cpuacct:/docker/c1\n")
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert not quota("v1")
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")
    assert quota("v1")


@pytest.mark.fast
def test_admission_settles_where_a_queueing_scheduler_meets_its_target():
    """A scheduler whose final wait grows as an M/M/1 queue's with its load, offered more
    sessions than it can serve: the capacity settles at the most sessions within the target
    and stays there, trying one more ever less often."""
    from cosyvoice.asr.admission import Admission
    service_s, cost = 0.08, 0.09  # a final's decode; busy fraction a session adds

    def wait(n: int) -> float:
        rho = min(0.99, n * cost)
        return service_s / (1 - rho)

    best = max(n for n in range(1, 12) if wait(n) <= 0.3)
    adm = Admission(start=2, ceiling=20, targets=targets(final_s=0.3, busy=0.95))
    seen = []
    for _ in range(200):
        n = adm.capacity  # the gateway fills every free place
        seen.append(adm.update(n, min(1.0, n * cost), [wait(n)] * W, [0.5] * W))
    assert best == 8 and seen.index(best) < 20  # from 2, one a renewal
    tail = seen[-100:]
    assert set(tail) <= {best, best + 1}  # never below the best
    assert tail.count(best + 1) <= 2  # a probe at 9 every 40, then 80, then 160 renewals


@pytest.mark.fast
def test_admission_counts_real_time_sessions_by_the_audio_fed():
    """One file sent three times as fast as it plays keeps the scheduler as busy as three
    microphones: it is three real-time sessions' worth, not one expensive session, and a
    process that served it does not keep a capacity of one once it is idle."""
    from cosyvoice.asr.admission import Admission
    adm = Admission(start=6, ceiling=12, targets=targets(busy=0.6))
    for _ in range(10):
        adm.update(1, 0.27, [0.1] * W, [0.4] * W, realtime=3.0)
    assert adm.cost == pytest.approx(0.09) and adm.fit() == 6 and adm.capacity == 6
    counted_by_sessions = Admission(start=6, ceiling=12, targets=targets(busy=0.6))
    for _ in range(10):
        counted_by_sessions.update(1, 0.27, [0.1] * W, [0.4] * W)
    assert counted_by_sessions.capacity == 2  # what counting sessions made of it
    # sessions that send nothing say nothing about the cost
    quiet = Admission(start=6, ceiling=12, targets=targets(busy=0.6))
    for _ in range(10):
        quiet.update(2, 0.0, [], [], realtime=0.0)
    assert quiet.cost is None and quiet.capacity == 6


@pytest.mark.fast
def test_admission_leaves_out_the_waits_of_a_backlog_caught_up():
    """One session replaying its backlog at five times real time queues its own finals:
    that is no reason to admit fewer microphones. The same waits from five real-time
    sessions are."""
    from cosyvoice.asr.admission import Admission
    backlog = Admission(start=6, ceiling=12, targets=targets(final_s=0.3))
    for _ in range(3):
        backlog.update(1, 0.5, [0.9] * W, [0.4] * W, realtime=5.0)
    assert backlog.capacity == 6 and not backlog.finals
    loaded = Admission(start=6, ceiling=12, targets=targets(final_s=0.3))
    loaded.update(5, 0.5, [0.9] * W, [0.4] * W, realtime=5.0)
    assert loaded.capacity == 4 and loaded.reason == "over target"


@pytest.mark.fast
def test_admission_counts_a_finals_decode_as_well_as_its_wait():
    """A slower model's finals (the multilingual model's take about twice tiny.en's) reach
    their text later at the same queue wait: the final's time from hand-over to text is
    judged too, so a process serving them admits fewer sessions."""
    from cosyvoice.asr.admission import Admission
    quick = Admission(start=6, ceiling=12, targets=targets(final_s=0.3, final_time_s=0.45))
    quick.update(6, 0.5, [0.2] * W, [0.4] * W, final_times=[0.3] * W)
    assert quick.capacity == 6  # wait 0.2 + decode 0.1: within both targets
    slow = Admission(start=6, ceiling=12, targets=targets(final_s=0.3, final_time_s=0.45))
    slow.update(6, 0.5, [0.2] * W, [0.4] * W, final_times=[0.5] * W)
    assert slow.capacity == 5 and slow.reason == "over target"  # the same wait, decoded longer
    # one session's finals take what its decodes take: nothing admission can change
    alone = Admission(start=6, ceiling=12, targets=targets(final_s=0.3, final_time_s=0.45))
    alone.update(1, 0.1, [0.0] * W, [0.1] * W, final_times=[0.6] * W)
    assert alone.capacity == 6
    unjudged = Admission(start=6, ceiling=12, targets=targets(final_s=0.3))
    unjudged.update(6, 0.5, [0.2] * W, [0.4] * W, final_times=[0.5] * W)
    assert unjudged.capacity == 6  # no final-time target: the wait alone
    # a new capacity starts a new window of final times, as of waits
    assert not slow.final_times


@pytest.mark.fast
def test_admission_settles_lower_where_each_final_decodes_longer():
    """Two M/M/1 schedulers, one decoding finals twice as long at 1.5 times the cost a
    session (the multilingual model against tiny.en): with the final-time target, each
    settles at the most sessions whose wait plus decode stays within it."""
    from cosyvoice.asr.admission import Admission

    def settle(service_s: float, cost: float) -> tuple[int, list[int]]:
        def wait(n: int) -> float:
            return service_s / (1 - min(0.99, n * cost))

        best = max(n for n in range(1, 12)
                   if wait(n) <= 0.3 and wait(n) + service_s <= 0.45)
        adm = Admission(start=2, ceiling=20,
                        targets=targets(final_s=0.3, busy=0.95, final_time_s=0.45))
        seen = []
        for _ in range(200):
            n = adm.capacity
            seen.append(adm.update(n, min(1.0, n * cost), [wait(n)] * W, [0.5] * W,
                                   final_times=[wait(n) + service_s] * W))
        return best, seen[-100:]

    tiny_best, tiny_tail = settle(0.08, 0.09)
    base_best, base_tail = settle(0.16, 0.135)
    assert base_best < tiny_best
    for best, tail in ((tiny_best, tiny_tail), (base_best, base_tail)):
        assert set(tail) <= {best, best + 1} and tail.count(best + 1) <= 2


# ---- partial cadence (cosyvoice/asr/cadence.py) -----------------------------------------

def cadence(**kw):
    from cosyvoice.asr.cadence import Cadence
    return Cadence(**{"base_s": 1.0, "floor_s": 2.0, "budget": 0.8, "wait_s": 0.4, **kw})


@pytest.mark.fast
def test_partials_keep_the_base_cadence_while_there_is_room():
    from cosyvoice.asr.cadence import partial_interval
    c = cadence()
    assert partial_interval(c, 0, 0.0, 0.0) == 1.0  # idle
    # 8 sessions of 50 ms partials a second: 0.4 of the scheduler, beside 0.3 of finals
    assert partial_interval(c, 8, 0.05, 0.3) == 1.0


@pytest.mark.fast
def test_partials_are_spaced_out_as_their_demand_outgrows_the_room_finals_leave():
    from cosyvoice.asr.cadence import partial_interval
    c = cadence()
    # 12 sessions x 50 ms = 0.6 s of decoding a second; finals take 0.3 of 0.8: 0.5 left
    assert partial_interval(c, 12, 0.05, 0.3) == 1.25  # 1.2 s, rounded up to a step
    # the interval grows with the sessions asking, the cost of a partial and the finals
    assert partial_interval(c, 14, 0.05, 0.3) == 1.5
    assert partial_interval(c, 12, 0.06, 0.3) == 1.5
    assert partial_interval(c, 12, 0.05, 0.4) == 1.5
    # each interval leaves the partials no more than the room: sessions x cost / interval
    for n in range(1, 40):
        got = partial_interval(c, n, 0.05, 0.3)
        assert got in (1.0, 1.25, 1.5, 1.75, 2.0)
        assert n * 0.05 / got <= 0.5 + 1e-9 or got == c.floor_s


@pytest.mark.fast
def test_the_floor_holds_however_heavy_the_load():
    from cosyvoice.asr.cadence import partial_interval
    c = cadence()
    assert partial_interval(c, 40, 0.05, 0.3) == 2.0
    assert partial_interval(c, 12, 0.05, 0.95) == 2.0  # finals take it all
    assert partial_interval(c, 12, 0.05, 0.3, wait_p95=3.0, previous=2.0) == 2.0


@pytest.mark.fast
def test_partials_waiting_over_target_push_the_interval_out_a_step_at_a_time():
    """The cores are busier than the measured costs say (another process on them): the
    partials' queue waits grow, and the interval grows one step a sample until they
    do not; back within target, the demand alone sets it."""
    from cosyvoice.asr.cadence import partial_interval
    c = cadence()
    assert partial_interval(c, 4, 0.05, 0.2, wait_p95=0.9, previous=1.0) == 1.25
    assert partial_interval(c, 4, 0.05, 0.2, wait_p95=0.9, previous=1.25) == 1.5
    assert partial_interval(c, 4, 0.05, 0.2, wait_p95=0.1, previous=1.5) == 1.0


def paced(partial_s: float, **kw) -> tuple[Recorder, DecodeScheduler]:
    """A scheduler with a cadence whose partial decodes take ``partial_s``."""
    rec = Recorder()
    rec.gate.set()

    def partials(jobs, between):
        time.sleep(partial_s * len(jobs))
        rec.calls.append(("partials", [j.result["name"] for j in jobs]))
        return [Decoded(j.result["name"]) for j in jobs]

    sched = DecodeScheduler(rec.final, rec.prepare, partials, max_batch=1,
                            cadence=cadence(**kw))
    return rec, sched


@pytest.mark.fast
def test_a_waiting_partial_replaced_by_a_newer_one_keeps_its_place_in_the_queue():
    rec = Recorder()
    sched = DecodeScheduler(rec.final, rec.prepare, rec.partials, max_batch=1)
    a, b, c = (StreamState() for _ in range(3))
    try:
        sched.submit(job("partial", a, "a1"))
        assert rec.started.wait(WAIT_S)  # a1 holds the thread
        b1 = job("partial", b, "b1")
        sched.submit(b1)
        sched.submit(job("partial", c, "c1"))
        b2 = job("partial", b, "b2")  # b has waited longest: b2 goes where b1 was
        sched.submit(b2)
        rec.gate.set()
        assert sched.wait_idle(WAIT_S)
    finally:
        sched.stop()
    assert [call[1] for call in rec.calls] == [["a1"], ["b2"], ["c1"]]
    assert b2.submitted == b1.submitted


@pytest.mark.fast
def test_the_scheduler_spaces_partials_out_when_its_sessions_ask_for_more_than_it_has():
    """Ten sessions asking for a partial every 0.1 s of 20 ms decodes: twice what the
    budget holds. The scheduler sets a longer interval for every session; each session's
    partials are decoded in turn (none starves); the load it reports says so."""
    rec, sched = paced(0.02, base_s=0.1, floor_s=1.0, budget=0.5, step_s=0.05)
    states = [StreamState() for _ in range(10)]
    try:
        sched.sample()
        deadline = time.monotonic() + 2.0
        k = 0
        while time.monotonic() < deadline:
            interval = sched.partial_interval
            assert interval is not None
            for i, st in enumerate(states):
                sched.speaking(st)  # in an utterance, as its stream says with every chunk
                sched.submit(job("partial", st, f"s{i}-{k}"))
            k += 1
            time.sleep(interval)
        load = sched.sample()
        assert sched.wait_idle(WAIT_S)
    finally:
        sched.stop()
    # 10 x 20 ms over 0.5 of the time: 0.4 s
    assert load.partial_interval == pytest.approx(0.4, abs=0.06)
    assert sched.partial_interval == load.partial_interval
    decoded = [call[1][0].split("-")[0] for call in rec.calls]
    counts = [decoded.count(f"s{i}") for i in range(10)]
    assert min(counts) >= 3 and max(counts) - min(counts) <= 2  # fair: no session starves
    assert load.final_busy == 0.0 and load.busy <= 0.8


@pytest.mark.fast
def test_admission_counts_the_partials_at_their_floor_cadence():
    from cosyvoice.asr.scheduler import Load
    # finals 0.2 of the time, partials 0.4 at a 1 s interval: at a 2 s floor, 0.2
    load = Load(0.6, [], [], [], final_busy=0.2, partial_interval=1.0)
    assert load.at_floor(2.0) == pytest.approx(0.4)
    at_floor = Load(0.6, [], [], [], final_busy=0.2, partial_interval=2.0)
    assert at_floor.at_floor(2.0) == pytest.approx(0.6)  # already there
    fixed = Load(0.6, [], [], [], final_busy=0.2)  # no cadence: as it is
    assert fixed.at_floor(2.0) == 0.6


@pytest.mark.fast
def test_a_refused_client_waits_for_its_place_at_the_measured_drain_rate():
    from cosyvoice.gateway.load import MAX_RETRY_MS, retry_after_ms
    assert retry_after_ms(None, 1, 2000) == 2000  # nothing ended lately: the setting
    assert retry_after_ms(0.25, 1, 2000) == 4000  # one place, a session ends every 4 s
    assert retry_after_ms(0.25, 3, 2000) == 12000  # two clients already ahead of it
    assert retry_after_ms(100.0, 1, 2000) == 2000  # draining fast: never under the setting
    assert retry_after_ms(0.001, 5, 2000) == MAX_RETRY_MS

"""Adaptive bitrate on emulated bad links: fixed PCM against ``--abr``, same audio, same links.

Each client runs in a network namespace of its own (``tests/netlink.py``: a veth pair, its
uplink shaped with ``tc tbf``), and reaches the service through an in-order userspace
proxy on the host's end that adds the profile's one-way delay and jitter to both
directions (``netem`` does not exist on these machines). The service (embedded Redis, a
gunicorn gateway with the default settings, ``COSYVOICE_ABR`` on among them, two worker
processes admitting half the sessions each, the default engine) runs on the host's loopback.
The ``--sessions`` sessions of one cell run at the same time, each on its own link, each
streaming ``--seconds`` of speech in real time; a cell takes about one session. Every
session says the same words, session ``i`` starting ``i/n`` of the way into the fixtures
and going round, so their utterances do not all end at the same instant (``--aligned``:
they do, and ten finals land on the workers at once); session ``i`` streams the same
audio over the same link in every cell.

Failure, defined before measuring: a session fails when

* its connection was lost and not resumed (the client gave up, or the stream ended with
  an error), or
* a final came more than 3 s after the end of its utterance's audio (from when the
  audio's last sample would have been captured, in real time), or
* its WER is above the WER of the same words (session 0's order) streamed as PCM over
  loopback before the cells (measured once per run) plus 5 points (the Opus rungs cost
  up to 2.4: Opus on the wire in docs/benchmarks.md).

Per cell: failures with a 95 % Wilson interval, chunk lag (from when a chunk's audio was
captured to its ack) P50/P95/P99, final latency P50 and P95, switches per session and the share of
audio on each rung.

Profiles (``--profiles``, all by default): ``control`` 1 Mbit/s and 150 +- 50 ms;
``step`` 1 Mbit/s, 200 kbit/s from 15 s to 45 s, then 1 Mbit/s again (80 ms); ``slow``
a constant 150 kbit/s (80 ms); ``slow3g`` 400 kbit/s with a 2 s round trip; ``edge``
64 kbit/s (80 ms), to state the limit.

    python benchmarks/abr.py [--profiles control,step,slow,slow3g,edge] [--sessions 10]
        [--seconds 60] [--modes fixed,abr] [--engine NAME] [--aligned] [--records DIR]
        [--json-out F]

The whole table (five profiles, two modes) takes about 13 minutes. A client still
streaming 30 s after its audio ended is stopped (SIGTERM: it writes what it got, and counts
as failed); before each cell the workers must have released the last cell's sessions, so
cells do not share the service's capacity or CPU. ``--records`` keeps every session's
record (acks, finals and switches with their times).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import wave
from collections import Counter, deque
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown  # noqa: E402
from benchmarks.stack import Stack, percentile, read_fixture  # noqa: E402
from benchmarks.transport import machine  # noqa: E402
from cosyvoice.settings import Settings  # noqa: E402
from tests.helpers import (  # noqa: E402
    corpus_wer,
    fixture_texts,
    harvard_texts,
    reference_text,
    write_pcm_wav,
)
from tests.netfault import CuttableProxy  # noqa: E402
from tests.netlink import slow_link  # noqa: E402
from tests.stack import scrape  # noqa: E402

FINAL_LATE_S = 3.0
# A client still streaming this long after its audio ended is stopped (and has failed: its
# finals are far more than FINAL_LATE_S late).
GRACE_S = 30.0
# Before a cell, the sessions of the last one must be gone from the workers (a stopped
# client's session waits out COSYVOICE_SESSION_GRACE_S for a resume): at most this long.
IDLE_TIMEOUT_S = 60.0
WER_MARGIN = 0.05
GAP_S = 0.6


@dataclass(frozen=True)
class Profile:
    name: str
    rate_kbit: int
    delay_ms: float  # one way, each direction
    jitter_ms: float
    steps: tuple[tuple[float, int], ...] = ()  # (at_s, rate_kbit) changes during a session


PROFILES = {
    "control": Profile("control", 1000, 75, 25),
    "step": Profile("step", 1000, 40, 10, ((15.0, 200), (45.0, 1000))),
    "slow": Profile("slow", 150, 40, 10),
    "slow3g": Profile("slow3g", 400, 1000, 50),
    "edge": Profile("edge", 64, 40, 10),
}


# ---- the session's audio --------------------------------------------------------------

def session_audio(seconds: float, turn: float = 0.0) -> tuple[bytes, str]:
    """Speech fixtures one after another with short pauses, to ``seconds``: (pcm, text).
    ``turn`` (0 to 1): start that far into the list of fixtures and go round, so that
    sessions with different turns say the same words with their utterances ending at
    other instants."""
    refs = {**fixture_texts(), **harvard_texts(), "harvard_long": reference_text("harvard_long")}
    gap = b"\x00\x00" * int(16000 * GAP_S)
    parts, texts, total = [], [], 0.0
    for name in sorted(refs):
        pcm = read_fixture(name)
        if total + len(pcm) / 32000 > seconds:
            continue
        parts.append(pcm)
        texts.append(refs[name])
        total += len(pcm) / 32000 + GAP_S
    first = int(turn * len(parts)) % len(parts)
    parts, texts = parts[first:] + parts[:first], texts[first:] + texts[:first]
    pcm = gap.join(parts)
    return pcm + b"\x00\x00" * max(0, int(16000 * seconds) - len(pcm) // 2), " ".join(texts)


# ---- an in-order delay line -----------------------------------------------------------

class DelayProxy(CuttableProxy):
    """Listens on ``host`` and forwards to the gateway on loopback, holding every piece of
    data ``delay_ms`` +- ``jitter_ms`` (uniform) in each direction, never out of order."""

    def __init__(self, host: str, upstream_port: int, delay_ms: float, jitter_ms: float,
                 seed: int):
        self.delay_s, self.jitter_s = delay_ms / 1000, jitter_ms / 1000
        self.rng = random.Random(seed)
        super().__init__(upstream_port, listen_host=host)

    def _bridge(self, client: socket.socket, upstream: socket.socket) -> None:
        for a, b in ((client, upstream), (upstream, client)):
            queue: deque[tuple[float, bytes]] = deque()
            ready = threading.Condition()
            threading.Thread(target=self._read, args=(a, queue, ready), daemon=True).start()
            threading.Thread(target=self._write, args=(b, queue, ready), daemon=True).start()

    def _read(self, src: socket.socket, queue: deque, ready: threading.Condition) -> None:
        last_due = 0.0
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            with ready:
                if data:
                    due = time.monotonic() + self.delay_s + self.rng.uniform(-self.jitter_s,
                                                                             self.jitter_s)
                    last_due = max(last_due, due)  # in order
                    queue.append((last_due, data))
                else:
                    queue.append((0.0, b""))
                ready.notify()
            if not data:
                return

    @staticmethod
    def _write(dst: socket.socket, queue: deque, ready: threading.Condition) -> None:
        while True:
            with ready:
                while not queue:
                    ready.wait(1.0)
                due, data = queue.popleft()
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                dst.sendall(data)
            except OSError:
                return

# ---- one session, run inside a namespace ----------------------------------------------

class Stopped(Exception):
    """The run's grace period ran out (SIGTERM) before the session ended."""


def _stop(_signum, _frame) -> None:
    raise Stopped("stopped: still streaming at the run's deadline")


def client_main(url: str, wav: str, abr: bool, out: str) -> None:
    """Stream ``wav`` in real time and write what happened, with times, to ``out`` (also
    when stopped by SIGTERM at the run's deadline: what it got until then, and why)."""
    from cosyvoice.client import StreamingClient, TranscribeError

    signal.signal(signal.SIGTERM, _stop)
    with wave.open(wav, "rb") as w:
        pcm = w.readframes(w.getnframes())
    client = StreamingClient(url, abr=abr, codec=None if abr else "pcm16")
    record: dict = {"error": None}
    started = time.monotonic()
    try:
        client.connect(timeout=20)
        started = time.monotonic()
        client.stream_pcm(pcm, 16000, pace="realtime", reconnect_timeout=30)
        if not client.wait_end(60):
            record["error"] = "no end"
        client.stop()
    except (TranscribeError, OSError, Stopped) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    # The record first: closing a connection whose uplink is full can outlast the run's
    # patience, and a client killed then must still have said what it got.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    result = client.result
    if result.fatal_errors:
        record["error"] = record["error"] or result.fatal_errors[-1].get("code")
    record.update(
        start=started,
        session=client.session_info.get("codec"),
        start_bitrate=client.session_info.get("bitrate"),
        acks=[[t - started, d["seq"]] for t, e, d in result.events
              if e == "ack" and "seq" in d and "error" not in d],
        finals=[[t - started, d["end"], d["text"]] for t, e, d in result.events
                if e == "text" and d["type"] == "final"],
        switches=[[t - started, e, d] for t, e, d in result.events
                  if e in ("switch_down", "switch_up")],
        resumes=result.resumes, text=result.text)
    with open(out, "w") as f:
        json.dump(record, f)
    try:
        client.close()
    except Exception:  # noqa: BLE001 - the record is written; a clean close is a nicety
        pass


# ---- a cell ---------------------------------------------------------------------------

@dataclass
class Judged:
    """One session's measures, and why it failed (empty: it did not)."""

    why: list[str]
    lags: list[float]
    final_latency: list[float]
    wer: float
    switches: int
    on_rung: dict[str, float]

    @property
    def failed(self) -> bool:
        return bool(self.why)


def wilson(failures: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if not n:
        return (0.0, 1.0)
    p = failures / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def judge(record: dict, ref_text: str, baseline_wer: float, seconds: float) -> Judged:
    """One session's measures and whether it failed (the definition above)."""
    lags = [t - (seq + 1) * 0.2 for t, seq in record["acks"]]
    finals = [t - end for t, end, _text in record["finals"]]
    wer = corpus_wer([ref_text], [record["text"]]) if record["text"] else 1.0
    why = []
    if record["error"]:
        why.append(f"lost: {record['error']}")
    if any(late > FINAL_LATE_S for late in finals):
        why.append(f"final {max(finals):.1f} s late")
    if wer > baseline_wer + WER_MARGIN:
        why.append(f"WER {wer:.3f}")
    # audio on each rung: from the start rung through each switch
    rung = ("opus" + str(record["start_bitrate"] // 1000)
            if record["session"] == "opus" else "pcm16")
    on_rung: dict[str, float] = {}
    at = 0.0
    for t, _event, data in record["switches"]:
        t = min(t, seconds)
        on_rung[rung] = on_rung.get(rung, 0.0) + t - at
        rung, at = ("opus" + str(data["bitrate"] // 1000)
                    if data["codec"] == "opus" else "pcm16"), t
    on_rung[rung] = on_rung.get(rung, 0.0) + max(0.0, seconds - at)
    return Judged(why, lags, finals, wer, len(record["switches"]), on_rung)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (a client writes its record and exits), then SIGKILL after 15 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_idle(stack: Stack, timeout: float = IDLE_TIMEOUT_S) -> float:
    """Until the workers decode no session (the last cell's are released); the wait."""
    assert stack.pool.metrics_url is not None
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not scrape(stack.pool.metrics_url).get("cosyvoice_worker_sessions", 0):
            break
        time.sleep(1.0)
    return time.monotonic() - started


def run_cell(stack: Stack, profile: Profile, abr: bool, audio: list[tuple[str, str]],
             baseline_wer: float, seconds: float, work: Path) -> dict:
    """One cell: session ``i`` streams ``audio[i]`` (its WAV, its text) over link ``i``."""
    sessions = len(audio)
    outs = [work / f"{profile.name}-{'abr' if abr else 'fixed'}-{i}.json" for i in range(sessions)]
    with ExitStack() as stack_:
        links = [stack_.enter_context(slow_link(profile.rate_kbit, index=i, limit="64kb"))
                 for i in range(sessions)]
        proxies = [DelayProxy(link.host_ip, stack.port, profile.delay_ms, profile.jitter_ms,
                              seed=i) for i, link in enumerate(links)]
        for proxy in proxies:
            stack_.callback(proxy.close)
        procs = [link.popen([sys.executable, os.path.abspath(__file__), "--client",
                             "--url", proxy.url, "--wav", wav, "--out", str(out)]
                            + (["--abr"] if abr else []), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
                 for link, proxy, out, (wav, _text)
                 in zip(links, proxies, outs, audio, strict=True)]
        started = time.monotonic()
        pending = list(profile.steps)
        while any(p.poll() is None for p in procs):
            if time.monotonic() - started > seconds + GRACE_S:
                stop_all(procs)
                break
            while pending and time.monotonic() - started >= pending[0][0]:
                _at, rate = pending.pop(0)
                for link in links:
                    link.set_rate(rate)
            time.sleep(0.1)
    judged: list[Judged] = []
    for out, (_wav, ref_text) in zip(outs, audio, strict=True):
        try:
            record = json.loads(out.read_text())
        except (OSError, ValueError):
            judged.append(Judged(["lost: the client wrote no record"], [], [], 1.0, 0, {}))
            continue
        judged.append(judge(record, ref_text, baseline_wer, seconds))
    failures = sum(j.failed for j in judged)
    lags = [x for j in judged for x in j.lags]
    finals = [x for j in judged for x in j.final_latency]
    on_rung: dict[str, float] = {}
    for j in judged:
        for rung, s in j.on_rung.items():
            on_rung[rung] = on_rung.get(rung, 0.0) + s
    total = sum(on_rung.values()) or 1.0
    return {
        "profile": profile.name, "mode": "abr" if abr else "fixed PCM", "sessions": sessions,
        "failures": failures, "failure_ci": wilson(failures, sessions),
        "lag_p50": percentile(lags, 50), "lag_p95": percentile(lags, 95),
        "lag_p99": percentile(lags, 99), "final_p50": percentile(finals, 50),
        "final_p95": percentile(finals, 95),
        "switches_per_session": sum(j.switches for j in judged) / sessions,
        "on_rung": {r: round(s / total, 3) for r, s in sorted(on_rung.items())},
        "wer_mean": sum(j.wer for j in judged) / sessions,
        # sessions failed for each cause (a session may have several)
        "why": dict(sorted(Counter(cause for j in judged
                                   for cause in {w.split(":")[0].split(" ")[0]
                                                 for w in j.why}).items())),
    }


def table(rows: list[dict]) -> str:
    header = ["profile", "mode", "failed", "95 % CI", "why", "chunk lag P50 / P95 / P99 s",
              "final P50 / P95 s", "switches / session", "audio per rung", "mean WER"]
    return markdown(header, (
        [r["profile"], r["mode"], f"{r['failures']}/{r['sessions']}",
         f"{100 * r['failure_ci'][0]:.0f}-{100 * r['failure_ci'][1]:.0f} %",
         ", ".join(f"{k} {n}" for k, n in r["why"].items()) or "-",
         f"{r['lag_p50']:.2f} / {r['lag_p95']:.2f} / {r['lag_p99']:.2f}",
         f"{r['final_p50']:.2f} / {r['final_p95']:.2f}",
         f"{r['switches_per_session']:.1f}",
         ", ".join(f"{k} {100 * v:.0f} %" for k, v in r["on_rung"].items() if v),
         f"{100 * r['wer_mean']:.1f} %"] for r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--engine", default=None,
                        help="COSYVOICE_ENGINE for the service (default: the service's own)")
    parser.add_argument("--modes", default="fixed,abr",
                        help="fixed (PCM, no switching), abr, or both")
    parser.add_argument("--aligned", action="store_true",
                        help="every session the same recording from the same start")
    parser.add_argument("--records", default=None,
                        help="a folder to keep every session's record in")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--wav", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--abr", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args.url, args.wav, args.abr, args.out)
        return
    if os.geteuid() != 0:
        sys.exit("benchmarks/abr.py creates network namespaces: run it as root")
    started = time.monotonic()
    rows: list[dict] = []
    # A fixed capacity: the decode scheduler's admission would otherwise lower it under the
    # load of the clients and links this machine also runs, and refuse sessions of a cell.
    env = {"COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           "COSYVOICE_WORKER_CAPACITY": str(-(-args.sessions // 2))}
    if args.engine:
        env["COSYVOICE_ENGINE"] = args.engine
    with (tempfile.TemporaryDirectory() as tmp,
          Stack(processes=2, env=env, metrics=True) as stack):
        work = Path(args.records or tmp)
        work.mkdir(parents=True, exist_ok=True)
        # Session i starts i/n of the way into the fixtures: ten users do not end their
        # sentences at the same instant (--aligned: they do, every finals at once).
        spoken = [session_audio(args.seconds, 0.0 if args.aligned else i / args.sessions)
                  for i in range(args.sessions)]
        audio = []
        for i, (pcm_i, text_i) in enumerate(spoken):
            wav = str(work / f"session-{i}.wav")
            write_pcm_wav(wav, pcm_i)
            audio.append((wav, text_i))
        pcm, ref_text = spoken[0]  # the baseline: session 0's order, as it starts at 0
        from cosyvoice.client import transcribe_pcm
        baseline = transcribe_pcm(stack.url, pcm, 16000, pace="fast", timeout=120)
        baseline_wer = corpus_wer([ref_text], [baseline.text])
        engine = env.get("COSYVOICE_ENGINE") or Settings().engine
        print(f"{engine}, baseline: {len(pcm) / 32000:.0f} s of audio, PCM over loopback WER "
              f"{100 * baseline_wer:.1f} %", flush=True)
        for name in args.profiles.split(","):
            for abr in [mode == "abr" for mode in args.modes.split(",")]:
                waited = wait_idle(stack)
                if waited > 2:
                    print(f"waited {waited:.0f} s for the last cell's sessions to go",
                          flush=True)
                row = run_cell(stack, PROFILES[name], abr, audio, baseline_wer, args.seconds,
                               work)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    print(f"\n{time.monotonic() - started:.0f} s, {machine()}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

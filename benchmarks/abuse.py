"""Hostile clients against the production gateway: what it holds and who still gets served.

One stack (gunicorn gateway, embedded Redis, a worker pool), one run, three phases:

  1. alone: a live session streams utterances in real time; `last` chunk ack -> final;
  2. under attack: ``--frames`` connections at once (spread over the WebSocket faces), each
     announcing a 300 MB frame and sending 1 MB blocks until the gateway closes it, then
     again a second later (a new wave of ``--frames`` every second), and
     ``--slow`` uploads trickle a chunked body (64 KB every 100 ms) to both HTTP faces,
     all at once, while the same live session streams again and ``/healthz`` is asked
     every 250 ms;
  3. one 200 MB chunked body to each HTTP face at full speed: how long after passing
     ``COSYVOICE_MAX_UPLOAD_MB`` its 413 came, and how much more was sent by then.

Reported: the gateway processes' RSS before and its peak during the attack, ``/healthz``
failures and its slowest answer, the live session's final latency under attack as a ratio
to alone, and the 413 timings.

    python benchmarks/abuse.py [--frames 50] [--slow 10] [--utterances 6] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.stack import Stack, last_to_final, percentile  # noqa: E402
from cosyvoice.gateway.apikeys import digest  # noqa: E402

FACES = {"socketio": "/socket.io/?EIO=4&transport=websocket",
         "realtime": "/v1/realtime?intent=transcription",
         "listen": "/v1/listen?encoding=linear16&sample_rate=16000"}
UPLOADS = ["/v1/audio/transcriptions", "/v1/listen"]
MB = 2**20
# The attackers' key and the live session's: two clients to the gateway's per-client limits
# (fair share), as they would be from two addresses
KEYS = {"attacker": "cv_abuse-attacker-000000000000", "victim": "cv_abuse-victim-0000000000000"}


def gateway_rss_mb(pid: int) -> float:
    """The gunicorn master and its processes, together."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / MB


def _connect(url: str) -> tuple[socket.socket, str]:
    """A socket to the gateway, and the Host header that names it."""
    host, port = url.split("://", 1)[1].split(":")
    return socket.create_connection((host, int(port)), timeout=30), f"{host}:{port}"


def _auth(path: str) -> str:
    scheme = "Token" if path.startswith("/v1/listen") else "Bearer"
    return f"Authorization: {scheme} {KEYS['attacker']}\r\n"


def big_frame(url: str, path: str, stop: threading.Event, sent: list[int]) -> None:
    """Once a second until ``stop``: upgrade, announce a 300 MB binary frame, send 1 MB
    blocks until the gateway ends the connection."""
    while not stop.wait(0 if not sent else 1.0):
        sock, host = _connect(url)
        try:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                         f"Connection: Upgrade\r\nSec-WebSocket-Key: "
                         f"dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                         f"Origin: {url}\r\n{_auth(path)}\r\n".encode())
            sock.recv(4096)  # the 101
            sock.sendall(struct.pack("!BBQ", 0x82, 0x80 | 127, 300 * MB) + b"\0\0\0\0")
            block = b"\0" * MB
            while not stop.is_set():
                sock.sendall(block)
                sent.append(MB)
        except OSError:
            pass  # the gateway closed it
        finally:
            sock.close()


def slow_body(url: str, route: str, stop: threading.Event) -> None:
    sock, host = _connect(url)
    try:
        sock.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: audio/wav\r\n"
                     f"Transfer-Encoding: chunked\r\n{_auth(route)}\r\n".encode())
        piece = b"%x\r\n" % (64 * 1024) + b"\0" * (64 * 1024) + b"\r\n"
        while not stop.is_set():
            sock.sendall(piece)
            time.sleep(0.1)
    except OSError:
        pass
    finally:
        sock.close()


def watch(url: str, pid: int, stop: threading.Event, out: dict) -> None:
    out.update(peak_mb=0.0, healthz_fail=0, healthz_max_ms=0.0, healthz=0)
    last_probe = 0.0
    while not stop.is_set():
        out["peak_mb"] = max(out["peak_mb"], gateway_rss_mb(pid))
        if time.monotonic() - last_probe >= 0.25:
            last_probe = time.monotonic()
            try:
                ok = requests.get(url + "/healthz", timeout=5).ok
            except requests.RequestException:
                ok = False
            out["healthz"] += 1
            out["healthz_fail"] += not ok
            out["healthz_max_ms"] = max(out["healthz_max_ms"],
                                        (time.monotonic() - last_probe) * 1000)
        time.sleep(0.05)


def body_413(url: str, route: str, limit_mb: int) -> dict:
    """A 200 MB chunked body at full speed: seconds from passing the limit to the 413."""
    sock, host = _connect(url)
    boundary = "abuse"
    if route == "/v1/audio/transcriptions":  # a form whose file part never ends
        content_type = f"multipart/form-data; boundary={boundary}"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n"
                f"whisper-1\r\n--{boundary}\r\nContent-Disposition: form-data; "
                f"name=\"file\"; filename=\"a.wav\"\r\n\r\n").encode()
    else:
        content_type, head = "audio/wav", b""
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\n"
                 f"Transfer-Encoding: chunked\r\n{_auth(route)}\r\n".encode())
    sock.sendall(b"%x\r\n" % len(head) + head + b"\r\n" if head else b"")
    piece = b"%x\r\n" % MB + b"\0" * MB + b"\r\n"
    sent, passed_at = 0, None
    try:
        while sent < 200 * MB and not select.select([sock], [], [], 0)[0]:
            sock.sendall(piece)
            sent += MB
            if passed_at is None and sent > limit_mb * MB:
                passed_at = time.monotonic()
        select.select([sock], [], [], 30)
    except OSError:
        pass  # the gateway answered and closed while we sent
    answered = time.monotonic()
    try:
        reply = sock.recv(4096)
    except OSError:
        reply = b""
    sock.close()
    status = int(reply.split(b" ", 2)[1]) if reply else 0
    return {"route": route, "status": status, "sent_mb": sent // MB,
            "after_limit_s": round(answered - passed_at, 3) if passed_at else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=50)
    ap.add_argument("--slow", type=int, default=10)
    ap.add_argument("--utterances", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--faces", default="socketio,realtime,listen",
                    help="the WebSocket faces the big frames go to")
    args = ap.parse_args()
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text("".join(f"{name} {digest(key)}\n" for name, key in KEYS.items()))
    with Stack(processes=args.workers, env={"COSYVOICE_API_KEYS_FILE": str(keys)}) as stack:
        pid = stack.gateway.proc.pid
        alone = last_to_final(stack.url, args.utterances, KEYS["victim"], timeout=60)
        before = gateway_rss_mb(pid)
        stop = threading.Event()
        watched: dict = {}
        sent: list[int] = []
        threads = [threading.Thread(target=watch, args=(stack.url, pid, stop, watched))]
        faces = [FACES[name] for name in args.faces.split(",")]
        threads += [threading.Thread(target=big_frame,
                                     args=(stack.url, faces[i % len(faces)], stop, sent))
                    for i in range(args.frames)]
        threads += [threading.Thread(target=slow_body,
                                     args=(stack.url, UPLOADS[i % 2], stop))
                    for i in range(args.slow)]
        for t in threads:
            t.start()
        try:
            attacked = last_to_final(stack.url, args.utterances, KEYS["victim"], timeout=60)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        after = gateway_rss_mb(pid)
        bodies = [body_413(stack.url, route, 25) for route in UPLOADS]
    row = {
        "frames": args.frames, "faces": args.faces, "slow_bodies": args.slow,
        "rss_before_mb": round(before, 1), "rss_peak_mb": round(watched["peak_mb"], 1),
        "rss_growth_mb": round(watched["peak_mb"] - before, 1),
        "rss_after_mb": round(after, 1), "attack_mb_sent": len(sent),
        "healthz": watched["healthz"], "healthz_failed": watched["healthz_fail"],
        "healthz_slowest_ms": round(watched["healthz_max_ms"]),
        "final_p50_alone_ms": round(percentile(alone, 50)),
        "final_p95_alone_ms": round(percentile(alone, 95)),
        "final_p50_attacked_ms": round(percentile(attacked, 50)),
        "final_p95_attacked_ms": round(percentile(attacked, 95)),
        "final_p95_ratio": round(percentile(attacked, 95) / percentile(alone, 95), 2),
        "bodies": bodies,
    }
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()

"""WebSocket unmasking: gevent-websocket's per-byte loop vs ``cosyvoice.fastws``.

Times one unmask of a frame payload the size of a 200 ms chunk at each supported rate
(the protobuf message around 16-bit PCM) and of a few other sizes, best of five runs.

    python benchmarks/unmask.py
"""

from __future__ import annotations

import json
import os
import sys
import timeit
from collections.abc import Callable
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from geventwebsocket.websocket import Header  # noqa: E402

from cosyvoice.gateway import fastws
from cosyvoice.wire.protocol import chunk_bytes  # noqa: E402

ENVELOPE = 30  # protobuf field tags and varints around the PCM of a chunk


def per_call_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    sizes = {"200 ms at 8 kHz": chunk_bytes(8000) + ENVELOPE,
             "200 ms at 16 kHz": chunk_bytes(16000) + ENVELOPE,
             "200 ms at 48 kHz": chunk_bytes(48000) + ENVELOPE,
             "ack-sized text frame": 40, "64 KiB": 65536}
    rows = []
    for name, n in sizes.items():
        payload, mask = os.urandom(n), os.urandom(4)
        header = Header(length=n)
        header.mask = mask
        assert fastws.xor_mask(payload, mask, n) == fastws.ORIGINAL_MASK_PAYLOAD(header, payload)
        stock = per_call_us(partial(fastws.ORIGINAL_MASK_PAYLOAD, header, payload),
                            max(3, 200_000 // max(n, 1)))
        fast = per_call_us(partial(fastws.xor_mask, payload, mask, n), 2000)
        rows.append({"payload": name, "bytes": n, "stock_us": round(stock, 2),
                     "fast_us": round(fast, 2), "speedup": round(stock / fast, 1)})
    print("| payload | bytes | gevent-websocket µs | fastws µs | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['payload']} | {r['bytes']} | {r['stock_us']} | {r['fast_us']} | "
              f"{r['speedup']}× |")
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()

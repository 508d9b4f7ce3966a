"""Fast WebSocket unmasking: byte for byte what gevent-websocket's own loop produces."""

from __future__ import annotations

import os
import random

import pytest
from geventwebsocket.websocket import Header

from cosyvoice.gateway import fastws

pytestmark = pytest.mark.unit

EDGE_SIZES = [0, 1, 2, 3, 4, 5, 7, 8, 125, 126, 127, 6400, 6430, 65535, 65536, 65537]
MASKS = [b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\x01\x02\x03\x04", b"\x80\x00\x00\x01"]


def original(payload, mask: bytes, length: int) -> bytearray:
    header = Header(length=length)
    header.mask = mask
    return fastws.ORIGINAL_MASK_PAYLOAD(header, payload)


def cases():
    rng = random.Random(20240611)
    sizes = EDGE_SIZES + [rng.randrange(0, 70000) for _ in range(60)]
    for i, n in enumerate(sizes):
        mask = MASKS[i % len(MASKS)] if i < 2 * len(MASKS) else rng.randbytes(4)
        yield n, mask, rng.randbytes(n)


@pytest.mark.parametrize("n, mask, payload", list(cases()),
                         ids=lambda v: str(v) if isinstance(v, int) else None)
@pytest.mark.fast
def test_unmask_is_byte_identical_to_gevent_websocket(n, mask, payload):
    expected = original(payload, mask, n)
    for given in (payload, bytearray(payload)):
        got = fastws.xor_mask(given, mask, n)
        assert type(got) is bytearray
        assert got == expected
    assert fastws.xor_mask(fastws.xor_mask(payload, mask, n), mask, n) == payload


@pytest.mark.fast
def test_bytes_past_the_declared_length_are_left_alone_like_the_original():
    payload, mask = os.urandom(40), os.urandom(4)
    assert fastws.xor_mask(payload, mask, 33) == original(payload, mask, 33)
    with pytest.raises(IndexError):
        original(payload, mask, 41)
    with pytest.raises(IndexError):
        fastws.xor_mask(payload, mask, 41)


@pytest.mark.fast
def test_create_app_installs_it_once_for_every_header(monkeypatch):
    import redis

    from cosyvoice.settings import Settings
    from cosyvoice.webui import create_app

    monkeypatch.setattr(Header, "mask_payload", fastws.ORIGINAL_MASK_PAYLOAD)
    monkeypatch.setattr(Header, "unmask_payload", fastws.ORIGINAL_MASK_PAYLOAD)
    assert not fastws.installed()
    create_app(Settings(), client=redis.Redis(port=1), relay_results=False)
    assert fastws.installed()
    fastws.install()
    header = Header(length=5)
    header.mask = b"\x01\x02\x03\x04"
    assert header.unmask_payload(b"hello") == original(b"hello", header.mask, 5)

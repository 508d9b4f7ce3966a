"""Deepgram's pre-recorded face: ``POST /v1/listen`` (a recording in the body, or ``GET``
and the rest answered in Deepgram's shape), each channel through a cosyvoice session as a
file (cosyvoice/gateway/files.py), the response with ``utterances`` where asked
(docs/deepgram.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from typing import Any
from urllib.parse import parse_qs

import gevent
import gevent.event
import gevent.lock
from flask import Response, request

from ...gateway.core import Gateway
from ...gateway.files import FileSession
from ...gateway.limits import (
    BadBody,
    BodyTooLarge,
    parse_auth,
    read_body,
)
from ...text import speakers
from ...wire.audio import off_the_loop
from ...wire.errors import CosyvoiceError, Unauthorized
from ...wire.live_audio import (
    RAW_ENCODINGS,
    open_input,
)
from .params import (
    ListenError,
    Params,
    alternative,
    credential,
    flag,
    from_cosyvoice,
    metadata,
    speaker_number,
)

log = logging.getLogger(__name__)

# ---- pre-recorded: POST /v1/listen -------------------------------------------------------


def http(gateway: Gateway):
    """``POST /v1/listen``: a whole recording's transcript, per channel with
    ``multichannel=true``; a plain ``GET`` is told to upgrade."""
    request_id = str(uuid.uuid4())
    if request.method != "POST":
        return ListenError(426, "UPGRADE_REQUIRED", "this is a WebSocket endpoint for live "
                           "audio, or POST a recording").response(request_id)
    try:
        return prerecorded(gateway, request_id)
    except ListenError as err:
        return err.response(request_id)


def prerecorded(gateway: Gateway, request_id: str):
    try:
        subject = gateway.auth.check(credential(request.environ))
    except Unauthorized as err:
        raise ListenError(401, "INVALID_AUTH", f"invalid credentials: {err.msg}") from None
    query = parse_qs(request.query_string.decode("latin-1"), keep_blank_values=True)
    params = Params.parse(query, gateway, live=False)
    params.split = flag(query, "multichannel")
    if "json" in (request.content_type or ""):
        raise ListenError(400, "Bad Request", "send the recording itself as the request "
                          "body: this server does not fetch URLs")
    limit = gateway.settings.max_upload_mb * 1024 * 1024
    try:
        body = read_body(request.environ, limit)
    except BadBody as err:
        raise ListenError(400, "Bad Request", str(err)) from None
    except BodyTooLarge:
        raise ListenError(413, "PAYLOAD_TOO_LARGE", f"the recording is larger than "
                          f"{gateway.settings.max_upload_mb} MB "
                          f"(COSYVOICE_MAX_UPLOAD_MB)") from None
    if not body:
        raise ListenError(400, "Bad Request", "the request body holds no audio")
    streams, rate = off_the_loop(decode_recording, body, params)
    if not any(streams):
        raise ListenError(400, "Bad Request", "the payload cannot be decoded as audio")
    if params.split:
        params.channels = len(streams)
    finals = transcribe_channels(gateway, params, streams, rate, subject)
    about = metadata(request_id, hashlib.sha256(body).hexdigest(),
                     max(len(pcm) / 2 / rate for pcm in streams), params)
    channels = []
    for channel_finals in finals:
        joined = {"text": " ".join(f["text"].strip() for f in channel_finals
                                   if f["text"].strip()),
                  "words": [{**w, "speaker": w.get("speaker") or f.get("speaker")}
                            for f in channel_finals for w in f.get("words") or []]}
        channels.append({"alternatives": [alternative(joined, params)]})
    results: dict[str, Any] = {"channels": channels}
    if flag(query, "utterances"):
        results["utterances"] = utterances(finals, params, request_id)
    return Response(json.dumps({"metadata": about, "results": results}),
                    mimetype="application/json", headers={"dg-request-id": request_id})


def transcribe_channels(gateway: Gateway, params: Params, streams: list[bytes], rate: int,
                        subject: str) -> list[list[Any]]:
    """Each stream's finals, the streams through sessions of their own at once."""
    try:
        req = parse_auth(params.session_auth(rate, file=True), gateway.modes,
                         gateway.settings.accepted_codecs, (), gateway.languages)
    except CosyvoiceError as err:
        raise ListenError(400, "Bad Request", err.msg) from None
    sessions = [FileSession(gateway, pcm, rate, req, label="listen", subject=subject)
                for pcm in streams]
    try:
        for session in sessions:
            session.open()
        jobs = [gevent.spawn(lambda s=s: list(s.finals())) for s in sessions]
        gevent.joinall(jobs)
        for job in jobs:
            if job.exception is not None:
                raise job.exception
        finals = [job.value for job in jobs]
    except CosyvoiceError as err:
        raise from_cosyvoice(err) from err
    finally:
        for session in sessions:
            session.close()
    if params.diarize:  # every piece of the recording at once labels better than live
        finals = [speakers.recluster(f) for f in finals]
    return finals


def utterances(finals: list[list[Any]], params: Params, request_id: str) -> list[dict]:
    """``utterances=true``: every final of every channel, as Deepgram lists them."""
    return [{"start": f["start"], "end": f["end"], "channel": index,
             "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{request_id}/{index}/{i}")),
             **alternative(f, params),
             **({"speaker": speaker_number(f.get("speaker"))} if params.diarize else {})}
            for index, channel_finals in enumerate(finals)
            for i, f in enumerate(channel_finals) if f["text"].strip()]


def decode_recording(body: bytes, params: Params) -> tuple[list[bytes], int]:
    """A recording's PCM per session (per channel with ``split``) and its rate."""
    if params.encoding in RAW_ENCODINGS:
        decoder = open_input(params.encoding, params.sample_rate, params.channels,
                             params.split)
        streams = decoder.feed(body)
        streams = [a + b for a, b in zip(streams, decoder.flush(), strict=True)]
        return streams, decoder.rate
    from ...wire.audio import AudioFileError, read_channels
    try:
        streams, rate = read_channels(body, split=params.split)
    except AudioFileError as err:
        raise ListenError(400, "Bad Request", str(err)) from None
    return streams, rate

"""OpenAI's transcription face: ``POST /v1/audio/transcriptions`` and ``GET /v1/models``
on the gateway's port, for applications written against the ``openai`` package
(docs/openai.md).

An upload is decoded by PyAV (the container sniffed from its bytes, never from the part's
type) in the gateway's thread pool, so the gateway's other sockets do not wait for it,
and transcribed through a live session (cosyvoice/gateway/files.py): the same admission, client
slots, rate limit, worker take-over and session options as a Socket.IO client's. Errors
come in OpenAI's body shape, ``{"error": {message, type, param, code}}``, with the status
the ``openai`` client maps to its exception classes; a full service answers 429 with
``retry-after-ms``, which the stock client waits and retries by itself.
"""

from __future__ import annotations

import io
import json
import logging
import math
import zlib
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, jsonify, request, stream_with_context
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from ...gateway.core import Gateway
from ...gateway.files import FileSession
from ...gateway.limits import MAX_PROMPT_CHARS, parse_auth
from ...settings import Settings
from ...text import speakers, subtitles
from ...text.speakers import recluster
from ...wire.audio import AudioFileError, off_the_loop, read_audio
from ...wire.errors import (
    CosyvoiceError,
    Overloaded,
    RateLimited,
    Unauthorized,
    Unavailable,
    UnsupportedLanguage,
    UnsupportedMode,
)
from ...wire.languages import WHISPER_LANGUAGES, join_texts, joined_piece, unspaced
from ...wire.messages import Result

log = logging.getLogger(__name__)

PREFIX = "/v1"
FORMATS = ("json", "text", "srt", "verbose_json", "vtt", "diarized_json")
GRANULARITIES = ("word", "segment")
# OpenAI's model ids that clients send, each served by the default session mode;
# ``cosyvoice/<mode>`` names one of the engine's modes.
OPENAI_MODELS = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
NATIVE = "cosyvoice/"


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.retry_after_ms = retry_after_ms

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> Response:
        response = jsonify(self.body())
        response.status_code = self.status
        if self.retry_after_ms is not None:
            response.headers["retry-after-ms"] = str(self.retry_after_ms)
            response.headers["retry-after"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
        return response


def from_cosyvoice(err: CosyvoiceError, param: str | None = None) -> ApiError:
    """A session's refusal or failure as OpenAI's error (the code is cosyvoice's)."""
    if isinstance(err, Unauthorized):
        return ApiError(401, err.msg, code="invalid_api_key")
    if isinstance(err, Overloaded):
        return ApiError(429, err.msg, "server_error", code=err.code,
                        retry_after_ms=err.retry_after_ms)
    if isinstance(err, RateLimited):
        return ApiError(429, err.msg, "rate_limit_error", code="rate_limit_exceeded",
                        retry_after_ms=err.retry_after_ms or 1000)
    if isinstance(err, (UnsupportedLanguage, UnsupportedMode)):
        return ApiError(400, err.msg, param=param, code=err.code)
    if isinstance(err, Unavailable):
        return ApiError(503, err.msg, "server_error", code=err.code, retry_after_ms=1000)
    return ApiError(500, err.msg, "server_error", code=err.code)


def models(gateway: Gateway) -> list[dict]:
    """The model ids this server answers to: OpenAI's, then one per session mode."""
    ids = [*OPENAI_MODELS, *(NATIVE + mode for mode in gateway.modes)]
    return [{"id": i, "object": "model", "created": 0, "owned_by": "cosyvoice"} for i in ids]


def mode_for(model: str, gateway: Gateway) -> str:
    """The session mode a model id asks for: ``cosyvoice/<mode>``, else the default."""
    if model.startswith(NATIVE):
        mode = model[len(NATIVE):]
        if mode not in gateway.modes:
            raise ApiError(404, f"the model {model!r} does not exist on this server",
                           param="model", code="model_not_found")
        return mode
    return gateway.modes[0]


def install(app: Flask, gateway: Gateway) -> None:
    settings = gateway.settings
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_mb * 1024 * 1024
    app.register_error_handler(ApiError, lambda err: err.response())
    app.register_error_handler(HTTPException, lambda err: http_error(err, settings))
    app.add_url_rule(PREFIX + "/models", "openai_models", lambda: list_models(gateway))
    app.add_url_rule(PREFIX + "/models/<path:model>", "openai_model",
                     lambda model: one_model(gateway, model))
    app.add_url_rule(PREFIX + "/audio/transcriptions", "openai_transcriptions",
                     lambda: transcriptions(gateway), methods=["POST"])


def http_error(err: HTTPException, settings: Settings):
    """Werkzeug's own refusals (an upload over the limit, a form that does not parse, an
    unknown path or method) in OpenAI's shape under ``/v1/``; elsewhere as they are."""
    if not request.path.startswith(PREFIX + "/"):
        return err
    if isinstance(err, RequestEntityTooLarge):
        response = ApiError(413, f"the upload is larger than {settings.max_upload_mb} MB",
                            param="file", code="file_too_large").response()
        response.headers["Connection"] = "close"  # the rest of the body is not read
        return response
    status = err.code or 400
    response = ApiError(status, err.description or err.name,
                        "invalid_request_error" if status < 500 else "server_error").response()
    for name, value in err.get_headers():  # a 405's Allow, as RFC 9110 asks
        if name.lower() != "content-type":
            response.headers[name] = value
    return response


def authorize(gateway: Gateway) -> str:
    """The client's name: its ``Authorization: Bearer`` key (cosyvoice/gateway/apikeys.py: an API
    key or a signed token) where the gateway asks for one; 401 otherwise."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    try:
        return gateway.auth.check(key.strip() if scheme.lower() == "bearer" else None)
    except Unauthorized as err:
        raise ApiError(401, err.msg + " (Authorization: Bearer)", code="invalid_api_key") from err


def list_models(gateway: Gateway):
    authorize(gateway)
    return jsonify(object="list", data=models(gateway))


def one_model(gateway: Gateway, model: str):
    authorize(gateway)
    for entry in models(gateway):
        if entry["id"] == model:
            return jsonify(entry)
    raise ApiError(404, f"the model {model!r} does not exist on this server",
                   param="model", code="model_not_found")


def transcriptions(gateway: Gateway):
    subject = authorize(gateway)
    ask = Request.parse(gateway)
    pcm, rate = decode_upload(ask.upload)
    try:
        req = parse_auth({"sample_rate": rate, "mode": ask.mode,
                          **({"language": ask.language} if ask.language else {}),
                          **({"diarize": "file"} if ask.diarize else {}),
                          **({"prompt": ask.prompt[-MAX_PROMPT_CHARS:]} if ask.prompt else {})},
                         gateway.modes, gateway.settings.accepted_codecs, (),
                         gateway.languages)
    except CosyvoiceError as err:
        raise from_cosyvoice(err, "language") from err
    session = FileSession(gateway, pcm, rate, req, label="openai", subject=subject)
    try:
        session.open()
    except CosyvoiceError as err:
        raise from_cosyvoice(err) from err
    if ask.stream:
        return Response(stream_with_context(sse(session, ask.diarize)),
                        mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        finals = list(session.finals())
    except CosyvoiceError as err:
        raise from_cosyvoice(err) from err
    finally:
        session.close()
    if ask.diarize:  # every piece of the file at once labels better than live
        finals = lettered(recluster(finals))
    return render(ask, finals, session.duration_s)


class Request:
    """The form fields of one transcription request, validated."""

    def __init__(self) -> None:
        self.upload = b""
        self.model = ""
        self.mode = ""
        self.language: str | None = None
        self.prompt = ""
        self.format = "json"
        self.granularities: list[str] = []
        self.include: list[str] = []
        self.temperature = 0.0
        self.stream = False
        self.diarize = False  # speaker labels: diarized_json, or a "-diarize" model

    @classmethod
    def parse(cls, gateway: Gateway) -> Request:
        try:
            form, files = request.form, request.files
        except (OSError, ValueError) as exc:  # a chunked body cut short or malformed
            raise ApiError(400, f"the request body is malformed: {exc}"[:200]) from None
        ask = cls()
        part = files.get("file")
        if part is None:
            raise ApiError(400, "the file part is missing: upload the audio as 'file'",
                           param="file")
        ask.upload = part.read()
        if not ask.upload:
            raise ApiError(400, "the uploaded file is empty", param="file")
        ask.model = form.get("model", "")
        if not ask.model:
            raise ApiError(400, "you must provide a model parameter", param="model")
        ask.mode = mode_for(ask.model, gateway)
        ask.language = form.get("language") or None
        ask.prompt = form.get("prompt", "")
        ask.format = form.get("response_format") or "json"
        if ask.format not in FORMATS:
            raise ApiError(400, f"response_format must be one of {list(FORMATS)}",
                           param="response_format")
        ask.granularities = (form.getlist("timestamp_granularities[]")
                             or form.getlist("timestamp_granularities"))
        for value in ask.granularities:
            if value not in GRANULARITIES:
                raise ApiError(400, f"timestamp_granularities must be among "
                               f"{list(GRANULARITIES)}", param="timestamp_granularities")
        ask.include = form.getlist("include[]") or form.getlist("include")
        for value in ask.include:
            if value != "logprobs":
                raise ApiError(400, "include may only name 'logprobs'", param="include")
        try:
            ask.temperature = float(form.get("temperature") or 0)
        except ValueError:
            raise ApiError(400, "temperature must be a number", param="temperature") from None
        if not 0 <= ask.temperature <= 1:
            raise ApiError(400, "temperature must be between 0 and 1", param="temperature")
        ask.stream = (form.get("stream") or "").lower() in ("true", "1")
        ask.diarize = ask.format == "diarized_json" or ask.model.endswith("-diarize")
        return ask


def decode_upload(data: bytes) -> tuple[bytes, int]:
    """16 kHz mono PCM of an upload, decoded in the hub's thread pool (PyAV releases the
    GIL: the gateway's other greenlets go on meanwhile); 400 for what is not audio."""
    try:
        pcm, rate = off_the_loop(read_audio, io.BytesIO(data))
    except AudioFileError as exc:
        message = str(exc).replace("standard input", "the upload")
        raise ApiError(400, message, param="file", code="invalid_audio") from None
    if not pcm:
        raise ApiError(400, "the upload holds no audio samples", param="file",
                       code="invalid_audio")
    return pcm, rate


# ---- responses --------------------------------------------------------------------------


def _language(finals: list[Result]) -> str:
    code = subtitles.language([dict(f) for f in finals]) or "en"
    return WHISPER_LANGUAGES.get(code, code).lower()


def _usage(duration_s: float) -> dict:
    return {"type": "duration", "seconds": max(1, math.ceil(duration_s))}


def _logprob(conf: float) -> float:
    return round(math.log(min(1.0, max(conf, 1e-6))), 4)


def segment(i: int, final: Result, temperature: float) -> dict:
    text = final["text"]
    words = final.get("words") or []
    raw = text.encode()
    return {"id": i, "seek": 0, "start": final["start"], "end": final["end"],
            "text": text, "tokens": [], "temperature": temperature,
            "avg_logprob": (round(sum(_logprob(w["conf"]) for w in words) / len(words), 4)
                            if words else 0.0),
            "compression_ratio": round(len(raw) / len(zlib.compress(raw)), 4) if raw else 0.0,
            "no_speech_prob": 0.0}


def words_of(finals: list[Result]) -> list[dict]:
    return [{"word": w["word"], "start": w["start"], "end": w["end"],
             "probability": w["conf"]} for f in finals for w in f.get("words") or []]


def render(ask: Request, finals: list[Result], duration_s: float) -> Response:
    finals = [f for f in finals if f["text"].strip()]
    plain: list[dict] = [dict(f) for f in finals]
    text = join_texts([f["text"] for f in finals], [f.get("language") for f in finals])
    if ask.format == "text":
        return Response(text + "\n", mimetype="text/plain")
    if ask.format == "srt":
        return Response(subtitles.to_srt(plain), mimetype="text/plain")
    if ask.format == "vtt":
        return Response(subtitles.to_vtt(plain), mimetype="text/plain")
    if ask.format == "diarized_json":
        return jsonify({"task": "transcribe", "duration": round(duration_s, 3), "text": text,
                        "segments": diarized_segments(finals), "usage": _usage(duration_s)})
    if ask.format == "verbose_json":
        body: dict[str, Any] = {"task": "transcribe", "language": _language(finals),
                                "duration": round(duration_s, 3), "text": text}
        if "segment" in ask.granularities or not ask.granularities:
            body["segments"] = [segment(i, f, ask.temperature) for i, f in enumerate(finals)]
        if "word" in ask.granularities:
            body["words"] = words_of(finals)
        body["usage"] = _usage(duration_s)
        return jsonify(body)
    body = {"text": text, "usage": _usage(duration_s)}
    if "logprobs" in ask.include:
        body["logprobs"] = [{"token": w["word"], "logprob": _logprob(w["conf"]),
                             "bytes": list(w["word"].encode())}
                            for f in finals for w in f.get("words") or []]
    return jsonify(body)


def letter(label: str) -> str:
    """A speaker as OpenAI names them: A, B, … (cosyvoice's S1, S2, …)."""
    index = speakers.label_index(label)
    return chr(ord("A") + index) if index < 26 else label


def lettered(finals: list[dict]) -> list[Result]:
    """Finals with their speakers (and their words') named as OpenAI names them."""
    out: list[Any] = []
    for f in finals:
        words = [{**w, "speaker": letter(w["speaker"])} if w.get("speaker") else w
                 for w in f.get("words") or []]
        out.append({**f, "words": words,
                    **({"speaker": letter(f["speaker"])} if f.get("speaker") else {})})
    return out


def diarized_segments(finals: list[Result], first: int = 0) -> list[dict]:
    """``transcript.text.segment`` objects: each final cut where its words' speaker
    changes (the speaker of most of it where it has no words)."""
    out: list[dict] = []
    for final in finals:
        plain: dict = dict(final)
        sep = "" if unspaced(final.get("language")) else " "
        words = subtitles.timed_words(plain)
        runs: list[list[tuple[str, float, float, str]]] = []
        for word in words:
            if runs and runs[-1][-1][3] == word[3]:
                runs[-1].append(word)
            else:
                runs.append([word])
        for run in runs:
            out.append({"type": "transcript.text.segment", "id": f"seg_{first + len(out)}",
                        "start": round(run[0][1], 3), "end": round(run[-1][2], 3),
                        "text": sep.join(w[0] for w in run),
                        "speaker": run[0][3] or final.get("speaker", "A")})
    return out


def deltas(finals: Iterator[Result]) -> Iterator[tuple[Result, str, str]]:
    """(final, delta, text so far) per final with text: the deltas join to exactly the
    text."""
    so_far, previous = "", None
    for final in finals:
        if not final["text"].strip():
            continue
        delta = joined_piece(so_far, previous, final["text"], final.get("language"))
        so_far, previous = so_far + delta, final.get("language")
        yield final, delta, so_far


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse(session: FileSession, diarize: bool = False) -> Iterator[str]:
    """``transcript.text.delta`` per final (and with speaker labels its
    ``transcript.text.segment`` events, labelled live: the file is not over yet), then
    ``transcript.text.done`` (or an error event); the session ends when the response
    does, a client that hangs up included."""
    text, segments = "", 0
    try:
        for final, delta, so_far in deltas(session.finals()):
            text = so_far
            yield _event({"type": "transcript.text.delta", "delta": delta})
            if diarize:
                for seg in diarized_segments(lettered([dict(final)]), segments):
                    segments += 1
                    yield _event(seg)
        yield _event({"type": "transcript.text.done", "text": text,
                      "usage": {"type": "tokens", "input_tokens": 0, "output_tokens": 0,
                                "total_tokens": 0}})
    except CosyvoiceError as err:
        yield _event(from_cosyvoice(err).body())
    finally:
        session.close()

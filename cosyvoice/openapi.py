"""The REST contract: an OpenAPI 3.1 document of the gateway's HTTP routes.

Served at ``GET /openapi.json``, copied into the docs (``docs/openapi.json``, rendered as
``docs/api.md`` by ``python -m cosyvoice.openapi``), validated by ``openapi-spec-validator``
and exercised by ``schemathesis`` against the live gateway in the suite, so the document and
the code answer for each other. The WebSocket faces (Socket.IO, ``/v1/realtime``, the live
``/v1/listen``) are described in their own pages; OpenAPI has no words for them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from flask import Flask, jsonify

from .faces.deepgram.params import CONTAINERS, RATES, VERSION
from .faces.openai.transcriptions import FORMATS, GRANULARITIES
from .settings import Settings
from .wire.live_audio import RAW_ENCODINGS

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _openai_error(description: str, headers: bool = False) -> dict[str, Any]:
    answer = _json(_ref("OpenAIError"), description)
    if headers:
        answer["headers"] = {"retry-after": {"$ref": "#/components/headers/RetryAfter"},
                             "retry-after-ms": {"$ref": "#/components/headers/RetryAfterMs"}}
    return answer


def _deepgram_error(description: str, headers: bool = False) -> dict[str, Any]:
    answer = _json(_ref("DeepgramError"), description)
    answer["headers"] = {"dg-request-id": {"schema": {"type": "string"}}}
    if headers:
        answer["headers"]["Retry-After"] = {"$ref": "#/components/headers/RetryAfter"}
    return answer


def _flag(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "boolean"}}


WORD = {"type": "object", "required": ["word", "start", "end"],
        "properties": {"word": {"type": "string"}, "start": {"type": "number"},
                       "end": {"type": "number"}, "probability": {"type": "number"},
                       "speaker": {"type": "string"}}}
SEGMENT = {"type": "object", "required": ["id", "start", "end", "text"],
           "properties": {"id": {"type": "integer"}, "start": {"type": "number"},
                          "end": {"type": "number"}, "text": {"type": "string"}}}

SCHEMAS: dict[str, Any] = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}},
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                       "created": {"type": "integer"}, "owned_by": {"type": "string"}}},
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": _ref("Model")}}},
    "Transcription": {
        "description": "`json`, `verbose_json` and `diarized_json`: the text, and with "
                       "`verbose_json` the language, duration, words and segments",
        "type": "object", "required": ["text"],
        "properties": {"text": {"type": "string"}, "task": {"const": "transcribe"},
                       "language": {"type": "string"}, "duration": {"type": "number"},
                       "words": {"type": "array", "items": WORD},
                       "segments": {"type": "array", "items": SEGMENT},
                       "usage": {"type": "object"}, "logprobs": {"type": "array"}}},
    "TranscriptionForm": {
        "type": "object", "required": ["file", "model"],
        "properties": {
            "file": {"type": "string", "contentMediaType": "application/octet-stream",
                     "description": "the recording, any format FFmpeg reads"},
            "model": {"type": "string", "description": "`whisper-1`, `gpt-4o-transcribe`, "
                      "`gpt-4o-mini-transcribe` or `cosyvoice/<mode>`"},
            "language": {"type": "string"},
            "prompt": {"type": "string"},
            "response_format": {"enum": list(FORMATS)},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "timestamp_granularities[]": {"type": "array",
                                          "items": {"enum": list(GRANULARITIES)}},
            "include[]": {"type": "array", "items": {"const": "logprobs"}},
            "stream": {"type": "boolean"}}},
    "DeepgramError": {
        "type": "object", "required": ["err_code", "err_msg", "request_id"],
        "properties": {"err_code": {"type": "string"}, "err_msg": {"type": "string"},
                       "request_id": {"type": "string"}}},
    "DeepgramResponse": {
        "type": "object", "required": ["metadata", "results"],
        "properties": {
            "metadata": {"type": "object",
                         "required": ["request_id", "sha256", "duration", "channels"],
                         "properties": {"request_id": {"type": "string"},
                                        "sha256": {"type": "string"},
                                        "duration": {"type": "number"},
                                        "channels": {"type": "integer"}}},
            "results": {
                "type": "object", "required": ["channels"],
                "properties": {
                    "channels": {"type": "array", "items": {
                        "type": "object", "required": ["alternatives"],
                        "properties": {"alternatives": {"type": "array", "items": {
                            "type": "object", "required": ["transcript", "words"],
                            "properties": {"transcript": {"type": "string"},
                                           "confidence": {"type": "number"},
                                           "words": {"type": "array"}}}}}}},
                    "utterances": {"type": "array"}}}}},
    "Status": {
        "type": "object", "required": ["status"],
        "properties": {"status": {"type": "string"}, "reason": {"type": "string"}}},
    "Load": {
        "type": "object",
        "properties": {"sessions": {"type": "integer"}, "capacity": {"type": "integer"},
                       "full": {"type": "boolean"}, "workers": {"type": "array"}}},
}


def _transcriptions(settings: Settings) -> dict[str, Any]:
    return {"post": {
        "operationId": "createTranscription", "tags": ["OpenAI"],
        "summary": "Transcribe a recording (OpenAI's audio API)",
        "security": [{}, {"bearer": []}],
        "requestBody": {"required": True, "content": {"multipart/form-data": {
            "schema": _ref("TranscriptionForm"),
            "encoding": {"file": {"contentType": "application/octet-stream"}}}}},
        "responses": {
            "200": {"description": "the transcript in `response_format`; with "
                                   "`stream=true`, server-sent events",
                    "content": {JSON: {"schema": _ref("Transcription")},
                                "text/plain": {"schema": {"type": "string"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": _openai_error("a bad field, or a file with no audio FFmpeg can read"),
            "401": _openai_error("no or a bad key where keys are required"),
            "404": _openai_error("`cosyvoice/<mode>` for a mode this server has not"),
            "405": _openai_error("another method"),
            "413": _openai_error(f"a body over `COSYVOICE_MAX_UPLOAD_MB` "
                                 f"({settings.max_upload_mb} MB), chunked or not"),
            "415": _openai_error("a body that is not multipart/form-data"),
            "429": _openai_error("every worker is busy, or the client holds its sessions",
                                 headers=True),
            "503": _openai_error("Redis unreachable, or no result for 120 s")}}}


def _listen(settings: Settings) -> dict[str, Any]:
    params = [
        {"name": "model", "in": "query", "schema": {"type": "string"},
         "description": "a session mode of this server, else its default"},
        {"name": "language", "in": "query", "schema": {"type": "string"}},
        {"name": "encoding", "in": "query",
         "schema": {"enum": list(RAW_ENCODINGS + CONTAINERS)},
         "description": "raw audio's encoding; absent for a container (WAV, MP3, ...)"},
        {"name": "sample_rate", "in": "query",
         "schema": {"type": "integer", "minimum": RATES[0], "maximum": RATES[1]},
         "description": "required with a raw encoding"},
        {"name": "channels", "in": "query",
         "schema": {"type": "integer", "minimum": 1, "maximum": 8}},
        _flag("multichannel", "a transcript per channel"),
        _flag("punctuate", "punctuation and capitals"),
        _flag("smart_format", "numbers, dates and money as digits"),
        _flag("diarize", "speaker labels on words"),
        _flag("utterances", "the transcript cut into utterances"),
        {"name": "keyterm", "in": "query", "style": "form", "explode": True,
         "schema": {"type": "array", "items": {"type": "string"}}},
    ]
    return {
        "get": {"operationId": "listenUpgradeRequired", "tags": ["Deepgram"],
                "summary": "The live API is a WebSocket here; a plain GET is told so",
                "responses": {"426": _deepgram_error("upgrade to a WebSocket, or POST")}},
        "post": {
            "operationId": "listenPrerecorded", "tags": ["Deepgram"],
            "summary": "Transcribe a recording (Deepgram's pre-recorded API)",
            "security": [{}, {"token": []}],
            "parameters": params,
            "requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string",
                                                        "format": "binary"}},
                "audio/*": {"schema": {"type": "string", "format": "binary"}}}},
            "responses": {
                "200": _json(_ref("DeepgramResponse"), "the transcript"),
                "400": _deepgram_error("a bad parameter, an empty body or one with no "
                                       "audio, a JSON body (this server fetches no URL)"),
                "401": _deepgram_error("no or a bad key where keys are required"),
                "413": _deepgram_error(f"a body over `COSYVOICE_MAX_UPLOAD_MB` "
                                       f"({settings.max_upload_mb} MB), chunked or not"),
                "429": _deepgram_error("every worker is busy", headers=True),
                "503": _deepgram_error("Redis unreachable, or no result for 120 s")}}}


def _probe(op: str, summary: str, schema: str, unavailable: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": _json(_ref(schema), summary)}
    if unavailable:
        responses["503"] = _json(_ref("Status"), "not ready: Redis or every worker gone")
    return {"get": {"operationId": op, "tags": ["Operations"], "summary": summary,
                    "responses": responses}}


def document(settings: Settings | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the gateway's REST routes."""
    settings = settings or Settings()
    return {
        "openapi": "3.1.0",
        "info": {"title": "cosyvoice", "version": VERSION,
                 "description": "Real-time speech-to-text. The REST routes: OpenAI's and "
                                "Deepgram's file APIs, the models, and the operators' "
                                "probes. The WebSocket faces are in docs/protocol.md, "
                                "docs/openai.md and docs/deepgram.md."},
        "paths": {
            "/v1/models": {"get": {
                "operationId": "listModels", "tags": ["OpenAI"],
                "summary": "The model ids this server answers to",
                "security": [{}, {"bearer": []}],
                "responses": {"200": _json(_ref("ModelList"), "the models"),
                              "401": _openai_error("no or a bad key")}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel", "tags": ["OpenAI"],
                "summary": "One model id",
                "security": [{}, {"bearer": []}],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "minLength": 1}}],
                "responses": {"200": _json(_ref("Model"), "the model"),
                              "401": _openai_error("no or a bad key"),
                              "404": _openai_error("no such model here")}}},
            "/v1/audio/transcriptions": _transcriptions(settings),
            "/v1/listen": _listen(settings),
            "/openapi.json": {"get": {
                "operationId": "openapi", "tags": ["Operations"],
                "summary": "This document",
                "responses": {"200": _json({"type": "object", "required": ["openapi"]},
                                           "the OpenAPI 3.1 document")}}},
            "/healthz": _probe("healthz", "the gateway process answers", "Status", False),
            "/readyz": _probe("readyz", "Redis answers and a worker is alive", "Status",
                              True),
            "/load": _probe("load", "sessions, capacity and each worker's load", "Load",
                            True),
        },
        "components": {
            "schemas": SCHEMAS,
            "headers": {
                "RetryAfter": {"schema": {"type": "string"},
                               "description": "seconds before a retry may be admitted"},
                "RetryAfterMs": {"schema": {"type": "string"},
                                 "description": "the same in milliseconds"}},
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "an API key or a token (OpenAI's faces)"},
                "token": {"type": "apiKey", "in": "header", "name": "Authorization",
                          "description": "`Token <key>` (Deepgram's face)"}}},
    }


def install(app: Flask, gateway) -> None:
    """``GET /openapi.json``: the document for this gateway's settings."""
    served = document(gateway.settings)
    app.add_url_rule("/openapi.json", "openapi", lambda: jsonify(served))


def markdown(doc: dict[str, Any]) -> str:
    """The document as a page of the docs: each route, its parameters and answers."""
    lines = ["# REST API", "",
             "The REST routes' contract, generated from the OpenAPI 3.1 document the gateway",
             "serves at `GET /openapi.json` ([the document](openapi.json)); "
             "`python -m cosyvoice.openapi --markdown` writes this page again.",
             "The WebSocket faces are in [the wire protocol](protocol.md),",
             "[OpenAI's Realtime](openai.md) and [Deepgram's live API](deepgram.md).", ""]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            lines += [f"## `{method.upper()} {path}`", "", op["summary"] + ".", ""]
            params = op.get("parameters", [])
            if params:
                lines += ["| parameter | in | schema |", "|---|---|---|"]
                lines += [f"| `{p['name']}` | {p['in']} | `{json.dumps(p['schema'])}` |"
                          for p in params]
                lines.append("")
            body = op.get("requestBody")
            if body:
                lines += ["Body: " + ", ".join(f"`{t}`" for t in body["content"]) + ".", ""]
            lines += ["| status | meaning |", "|---|---|"]
            lines += [f"| {code} | {answer['description']} |"
                      for code, answer in op["responses"].items()]
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    doc = document()
    if argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown(doc))
    else:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

"""The operator's commands beside the service: ``model`` (verify and convert the Whisper
model data), ``token`` (a signed client token), ``key`` (a new API key), ``usage`` (audio
seconds per key and day)."""

from __future__ import annotations

import json
from pathlib import Path

from ..settings import Settings
from .exits import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)


def cmd_model(settings: Settings, source: str | None, force: bool) -> int:
    from ..asr import model_data

    source = source or settings.whisper_checkpoint or None
    if source and not Path(source).is_file():
        raise CliError(EXIT_INPUT, f"cannot read {source}: no such file")
    try:
        device = model_data.resolve_device(settings.device)
        path = model_data.convert(settings.model_dir or None, source=source, device=device,
                                  force=force)
        ct2 = model_data.install_ct2(settings.model_dir or None)
    except model_data.CheckpointFileError as exc:
        raise CliError(EXIT_INPUT, str(exc)) from None
    except model_data.ModelDataError as exc:
        raise CliError(EXIT_FAILED, str(exc)) from None
    print(f"CTranslate2 model (SHA-256 verified): {ct2}")
    print(f"torch checkpoint: {path}")
    return EXIT_OK


def cmd_token(settings: Settings, subject: str) -> int:
    from ..gateway.tokens import issue

    if not settings.auth_secret:
        raise CliError(EXIT_USAGE, "set COSYVOICE_AUTH_SECRET or --auth-secret")
    print(issue(settings.auth_secret, subject))
    return EXIT_OK


def cmd_key(settings: Settings, name: str) -> int:
    from ..gateway.apikeys import KeyFileError, add

    if not settings.api_keys_file:
        raise CliError(EXIT_USAGE, "set COSYVOICE_API_KEYS_FILE or --api-keys-file")
    try:
        print(add(settings.api_keys_file, name))
    except (KeyFileError, OSError) as exc:
        raise CliError(EXIT_INPUT, str(exc)) from None
    return EXIT_OK


def cmd_usage(settings: Settings, days: int, as_json: bool) -> int:
    import datetime

    import redis

    from ..store import bus as busmod

    if not settings.redis_url:
        raise CliError(EXIT_USAGE, "set COSYVOICE_REDIS_URL or --redis-url")
    today = datetime.datetime.now(datetime.timezone.utc).date()
    wanted = [(today - datetime.timedelta(days=n)).isoformat() for n in range(max(1, days))]
    try:
        client = busmod.connect(settings.redis_url, cluster=settings.redis_cluster,
                                ca_file=settings.redis_ca_file)
        found = busmod.Bus(client).usage(wanted)
    except redis.RedisError as exc:
        raise CliError(EXIT_UNREACHABLE, f"cannot read usage from Redis: {exc}") from None
    if as_json:
        print(json.dumps(found, sort_keys=True))
        return EXIT_OK
    print(f"{'day':<10}  {'key':<24}  {'audio s':>10}")
    for day in sorted(found):
        for name, seconds in sorted(found[day].items()):
            print(f"{day:<10}  {name:<24}  {seconds:>10.1f}")
    return EXIT_OK

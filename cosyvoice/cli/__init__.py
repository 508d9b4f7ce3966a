"""The ``cosyvoice`` command: its parser and ``main``; the commands live beside it
(``serve``: serve, gateway, worker; ``transcribe``; ``admin``: model, token, key, usage).

Imports stay lazy: ``gateway`` must let gevent patch the standard library before redis
or Flask are imported.

Every failure ends with one line on stderr, ``cosyvoice COMMAND: what went wrong``, and
one of the ``EXIT_*`` statuses (cosyvoice/cli/exits.py; the table in docs/cli.md, "Exit
status").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Callable

from ..settings import Settings, SettingsError, _format, _parse
from ..text.subtitles import FORMATS
from ..wire.codecs import CODECS, parse_bitrate
from ..wire.languages import SCRIPTS
from ..wire.registry import SESSION_MODES
from .admin import cmd_key, cmd_model, cmd_token, cmd_usage
from .exits import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)
from .serve import cmd_calibrate, cmd_gateway, cmd_serve, cmd_worker
from .transcribe import cmd_transcribe

__all__ = ["EXIT_FAILED", "EXIT_INPUT", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REFUSED",
           "EXIT_UNREACHABLE", "EXIT_USAGE", "CliError", "build_parser", "main"]

SETTINGS_GROUP = "settings (each also a COSYVOICE_<NAME> variable; docs/configuration.md)"
SETTINGS_EPILOG = ("Every server setting is also a flag of this command (--redis-url, "
                   "--engine, ...) and a COSYVOICE_<NAME> variable: --help-settings lists "
                   "them.")


def _settings_parser(shown: bool = False) -> argparse.ArgumentParser:
    """Flags for every setting, named like the ``COSYVOICE_*`` variables. A command's
    ``--help`` leaves them out (its own arguments come first, not 90 settings);
    ``--help-settings`` lists them (``shown``)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group(SETTINGS_GROUP)
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        env = "COSYVOICE_" + f.name.upper()
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           type=_flag_type(f.name, str(f.type)), default=None,
                           metavar=str(f.type).upper(),
                           help=(f"{env} (default: {_format(getattr(defaults, f.name)) or '-'})"
                                 if shown else argparse.SUPPRESS))
    if not shown:
        parser.add_argument("--help-settings", action=_HelpSettings)
    return parser


class _HelpSettings(argparse.Action):
    """``--help-settings``: the settings this command takes as flags, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs=0, help="list the server settings, each a flag of this "
                                       "command and a COSYVOICE_<NAME> variable, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        listing = argparse.ArgumentParser(
            prog=parser.prog, usage=f"{parser.prog} [--SETTING VALUE ...]", add_help=False,
            parents=[_settings_parser(shown=True)],
            description="The server settings. A flag overrides its variable, which "
                        "overrides the default.")
        listing.print_help()
        parser.exit()


def _flag_type(name: str, type_name: str) -> Callable[[str], Any]:
    """How argparse reads a setting's flag (a bool as its variable is read)."""
    if type_name == "int":
        return int
    if type_name == "float":
        return float
    if type_name == "bool":
        return functools.partial(_parse, name, "bool")
    return str


def _settings(args: argparse.Namespace) -> Settings:
    names = {f.name for f in dataclasses.fields(Settings)}
    return Settings.from_env(**{k: v for k, v in vars(args).items() if k in names})


def _url(raw: str) -> str:
    from ..client import check_url
    try:
        return check_url(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {raw!r}")
    return value


def _speakers(raw: str) -> int:
    from ..text.speakers import MAX_SPEAKERS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SPEAKERS:
        raise argparse.ArgumentTypeError(f"a number of speakers from 1 to {MAX_SPEAKERS}")
    return value


def _bitrate(raw: str) -> int:
    try:
        value = parse_bitrate(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a bitrate above 0, got {raw!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = _settings_parser()
    parser = argparse.ArgumentParser(prog="cosyvoice", description="Real-time speech to text.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, purpose: str, settings: bool = True) -> argparse.ArgumentParser:
        """A subcommand whose --help says its purpose, then its own arguments."""
        return sub.add_parser(name, help=purpose, description=purpose,
                              parents=[common] if settings else [],
                              epilog=SETTINGS_EPILOG if settings else None)

    command("serve", "run everything on this machine: Redis (embedded unless --redis-url), "
                     "the gateway and the ASR workers")
    command("gateway", "run the gateway: the page, Socket.IO and the OpenAI and Deepgram "
                       "faces")
    worker = command("worker", "run ASR worker processes")
    worker.add_argument("--processes", type=int, default=None,
                        help="worker processes (default: --workers, 0 = one per core)")
    worker.add_argument("--calibrate", action="store_true",
                        help="measure what one worker process on this host holds with the "
                             "engine, print the COSYVOICE_WORKER_CAPACITY to set, and exit")
    tr = command("transcribe", "stream an audio file to a cosyvoice service and print its "
                               "transcript", settings=False)
    tr.add_argument("file", help="audio file in any format FFmpeg decodes (WAV, FLAC, MP3, "
                                 "Ogg/Opus, M4A/AAC, WebM, ...), or - for standard input")
    tr.add_argument("--url", type=_url, default="http://127.0.0.1:5000",
                    help="the service (http:// or https://)")
    tr.add_argument("--pace", choices=("realtime", "fast"), default="realtime")
    tr.add_argument("--json", action="store_true", help="one JSON object per event")
    tr.add_argument("--output-format", choices=FORMATS, default=None,
                    help="the transcript as a file: text, json (every final with its words, "
                         "times, confidences and engine), srt or vtt subtitles; default: "
                         "the live view on a terminal, else the --output file's extension, "
                         "else text")
    tr.add_argument("--output", "-o", default=None,
                    help="write the transcript to this file instead of standard output")
    tr.add_argument("--timeout", type=_positive, default=60.0,
                    help="seconds to wait for the final result after the last chunk")
    tr.add_argument("--token", default=os.environ.get("COSYVOICE_TOKEN"),
                    help="client token when the service requires one (or COSYVOICE_TOKEN)")
    tr.add_argument("--insecure", action="store_true",
                    help="do not verify the server's TLS certificate")
    tr.add_argument("--mode", choices=SESSION_MODES, default=None,
                    help="where finals come from (the server's engine decides what it offers)")
    tr.add_argument("--language", default=None, metavar="CODE",
                    help="the language spoken: auto (detected, the server's default where it "
                         "offers more than English) or a code such as en, zh, ja, de (GET "
                         "/config lists the server's)")
    tr.add_argument("--script", choices=SCRIPTS, default=None,
                    help="Chinese text in Simplified (hans, the default) or Traditional "
                         "(hant) characters")
    tr.add_argument("--format", action="store_true",
                    help="numbers, dates, times and money as digits (zh, en, ja)")
    tr.add_argument("--prompt", default=None, metavar="TEXT",
                    help="text the recognition follows, as if said before the audio: names, "
                         "terms, a spelling or a script to keep to (Whisper engines; at most "
                         "500 characters)")
    tr.add_argument("--diarize", action="store_true",
                    help="speaker labels (S1, S2, ...) on every final and word: live as the "
                         "text comes, and the transcript file's from all of the file's speech "
                         "at once")
    tr.add_argument("--multichannel", action="store_true",
                    help="each channel of the file its own stream (a call's agent and "
                         "customer): finals labelled C1, C2, ... in text, SRT and WebVTT, "
                         "and one transcript per channel in JSON")
    tr.add_argument("--speakers", type=_speakers, default=None, metavar="N",
                    help="with --diarize: the number of speakers, where you know it")
    tr.add_argument("--min-speakers", type=_speakers, default=None, metavar="N",
                    help="with --diarize: at least this many speakers")
    tr.add_argument("--max-speakers", type=_speakers, default=None, metavar="N",
                    help="with --diarize: at most this many speakers")
    tr.add_argument("--codec", choices=CODECS, default=None,
                    help="how the audio travels: pcm16 (raw 16-bit samples, about 270 "
                         "kbit/s; the default) or opus (20 ms Opus packets at --bitrate); "
                         "with --abr, where the session starts")
    tr.add_argument("--abr", action="store_true",
                    help="adaptive bitrate: start on the rung the server picks and switch "
                         "codec and bitrate when it says the link calls for it")
    tr.add_argument("--bitrate", type=_bitrate, default=None,
                    help="Opus bitrate, e.g. 24k (one the server offers; default: its best)")
    model = command("model", "verify the Whisper model data and convert it once into the "
                             "torch checkpoint the 2pass engine maps")
    model.add_argument("--from", dest="source", default=None,
                       help="an official openai-whisper checkpoint to use instead")
    model.add_argument("--force", action="store_true", help="convert again")
    tok = command("token", "issue a signed client token (needs COSYVOICE_AUTH_SECRET)")
    tok.add_argument("--subject", default="client", help="who the token is for")
    key = command("key", "print a new API key named NAME and add its hash to "
                         "COSYVOICE_API_KEYS_FILE (the key is not kept: copy it now)")
    key.add_argument("name", help="whose key it is (letters, digits, '.', '_', '-')")
    usage = command("usage", "audio seconds each key (or token subject) sent, per day")
    usage.add_argument("--days", type=int, default=7, help="days back from today (UTC)")
    usage.add_argument("--json", action="store_true", help="one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except CliError as exc:
        status, msg = exc.status, str(exc)
    except SettingsError as exc:
        status, msg = EXIT_USAGE, str(exc)
    except KeyboardInterrupt:
        status, msg = EXIT_INTERRUPTED, "interrupted"
    print(f"cosyvoice {args.command}: {msg}", file=sys.stderr, flush=True)
    return status


def _run(args: argparse.Namespace) -> int:
    if args.command == "gateway":
        return cmd_gateway(_settings(args))
    if args.command == "worker":
        if args.calibrate:
            return cmd_calibrate(_settings(args))
        return cmd_worker(_settings(args), args.processes)
    if args.command == "serve":
        return cmd_serve(_settings(args))
    if args.command == "token":
        return cmd_token(_settings(args), args.subject)
    if args.command == "key":
        return cmd_key(_settings(args), args.name)
    if args.command == "usage":
        return cmd_usage(_settings(args), args.days, args.json)
    if args.command == "model":
        return cmd_model(_settings(args), args.source, args.force)
    return cmd_transcribe(args)

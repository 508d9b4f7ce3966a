"""The ``cosyvoice`` command: serve, gateway, worker, transcribe, model, token, key, usage.

Imports stay lazy: ``gateway`` must let gevent patch the standard library before redis
or Flask are imported.

Every failure ends with one line on stderr, ``cosyvoice COMMAND: what went wrong``, and
one of the ``EXIT_*`` statuses below (the table in docs/cli.md, "Exit status").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .settings import Settings, SettingsError, _format, _parse
from .text.subtitles import FORMATS
from .wire.codecs import CODECS, OPUS, parse_bitrate
from .wire.languages import SCRIPTS
from .wire.registry import SESSION_MODES

EXIT_OK = 0
# The work failed once it had started: the stream ended with a server error or without
# its end within --timeout; a process of `serve` exited; model data failed verification;
# the gateway's port is taken.
EXIT_FAILED = 1
# A bad command line or setting (a flag, a COSYVOICE_* variable, a URL); argparse's own.
EXIT_USAGE = 2
# An input file that is missing, unreadable, or not audio cosyvoice reads.
EXIT_INPUT = 3
# No cosyvoice service answers at the URL, or the connection was lost and not restored.
EXIT_UNREACHABLE = 4
# The service refused the session (overloaded after the retries, unauthorized, ...).
EXIT_REFUSED = 5
# Stopped by Ctrl-C.
EXIT_INTERRUPTED = 130
# `serve` starts the worker pool once the gateway answers, or after this long regardless
SERVE_GATEWAY_WAIT_S = 30.0


class CliError(Exception):
    """Ends a command with one line on stderr and ``status``."""

    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


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
    from .client import check_url
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
    from .text.speakers import MAX_SPEAKERS
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


def cmd_model(settings: Settings, source: str | None, force: bool) -> int:
    from .asr import model_data

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
    from .gateway.tokens import issue

    if not settings.auth_secret:
        raise CliError(EXIT_USAGE, "set COSYVOICE_AUTH_SECRET or --auth-secret")
    print(issue(settings.auth_secret, subject))
    return EXIT_OK


def cmd_key(settings: Settings, name: str) -> int:
    from .gateway.apikeys import KeyFileError, add

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

    from .store import bus as busmod

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


def _process_count(settings: Settings, processes: int | None) -> int:
    n = processes if processes is not None else settings.workers
    return n if n > 0 else (os.cpu_count() or 1)


def cmd_gateway(settings: Settings) -> int:
    from gevent import monkey
    monkey.patch_all()
    from gevent import pywsgi

    from . import logs
    from .gateway.wshandler import Handler
    from .webui import create_app

    logs.setup(settings.log_level)
    if not settings.redis_url:
        raise CliError(EXIT_USAGE, "set COSYVOICE_REDIS_URL or --redis-url")
    app = create_app(settings)
    server = pywsgi.WSGIServer((settings.host, settings.port), app,
                               handler_class=Handler, log=None)
    try:
        server.init_socket()
    except OSError as exc:
        raise CliError(EXIT_FAILED, f"cannot listen on {settings.host}:{settings.port}: "
                                    f"{os.strerror(exc.errno) if exc.errno else exc}") from None

    def on_term(signum, frame):
        import gevent
        gevent.spawn(server.stop, timeout=5)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(f"gateway listening on http://{settings.host}:{settings.port}", file=sys.stderr,
          flush=True)
    server.serve_forever()
    return EXIT_OK


def cmd_calibrate(settings: Settings) -> int:
    """Decode the calibration audio as real-time sessions; print the capacity it implies."""
    from .asr.calibrate import calibrate

    c = calibrate(settings)
    print(f"engine {c.engine}: {c.cost:.3f} CPU-s per audio second per session here, "
          f"{c.reference_cost:.3f} on the reference host (capacity {c.reference_capacity}); "
          f"sessions per worker process here:", file=sys.stderr)
    print(f"COSYVOICE_WORKER_CAPACITY={c.capacity}")
    return 0


def cmd_worker(settings: Settings, processes: int | None) -> int:
    from . import logs, metrics_dir

    logs.setup(settings.log_level)
    if not settings.redis_url:
        raise CliError(EXIT_USAGE, "set COSYVOICE_REDIS_URL or --redis-url")
    if not settings.worker_metrics_port:
        from .worker.pool import run_pool
        return run_pool(settings, _process_count(settings, processes))
    # The pool's processes add up their metrics in one directory, chosen before
    # prometheus_client is imported (by .pool, through .worker).
    path, created = metrics_dir.choose("worker")
    metrics_dir.clear(path)
    from . import metrics
    from .worker.pool import run_pool
    try:
        metrics.serve_pool(settings.host, settings.worker_metrics_port)
        return run_pool(settings, _process_count(settings, processes))
    finally:
        if created:
            metrics_dir.remove(path)


def cmd_serve(settings: Settings) -> int:
    """Everything on one machine; Ctrl-C stops it all and leaves no process behind."""
    from .store.embedded_redis import EmbeddedRedis

    embedded = None
    if not settings.redis_url:
        embedded = EmbeddedRedis().start()
        settings = settings.replace(redis_url=embedded.url)
        print(f"embedded redis on {embedded.url}", file=sys.stderr, flush=True)
    env = {**os.environ, **settings.as_env()}
    nproc = _process_count(settings, None)
    stopping = {"n": 0}

    def on_signal(signum, frame):
        stopping["n"] += 1

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    children = [subprocess.Popen([sys.executable, "-m", "cosyvoice", "gateway"], env=env)]
    exited = None
    try:
        # The worker pool starts once the gateway answers: the pool reads how busy the
        # host's cores are while it loads its model (cosyvoice/worker/hostload.py), and a gateway
        # starting beside it would read as other work
        _wait_healthz(settings.host, settings.port, children[0], SERVE_GATEWAY_WAIT_S,
                      lambda: stopping["n"] > 0)
        if not stopping["n"] and children[0].poll() is None:
            children.append(subprocess.Popen([sys.executable, "-m", "cosyvoice", "worker",
                                              "--processes", str(nproc)], env=env))
            print(f"cosyvoice serving on http://{settings.host}:{settings.port}/ "
                  f"({nproc} ASR worker processes, engine {settings.engine})",
                  file=sys.stderr, flush=True)
        while not stopping["n"] and exited is None:
            exited = next((c for c in children if c.poll() is not None), None)
            time.sleep(0.2)
    finally:
        _stop_children(children, stopping)
        if embedded:
            embedded.stop()
    if exited is not None:
        name = "gateway" if exited is children[0] else "worker pool"
        raise CliError(EXIT_FAILED, f"the {name} exited with status {exited.returncode}; "
                                    "stopped everything")
    return EXIT_OK


def _wait_healthz(host: str, port: int, proc: subprocess.Popen, timeout: float,
                  stopped: Callable[[], bool]) -> None:
    """Until the server on ``host:port`` answers ``/healthz``, ``proc`` exits, ``stopped()``
    (Ctrl-C), or ``timeout``."""
    import urllib.request

    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    host = f"[{host}]" if ":" in host else host
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no HTTP_PROXY
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not stopped():
        try:
            with direct.open(f"http://{host}:{port}/healthz", timeout=1):
                return
        except OSError:
            time.sleep(0.2)


def _stop_children(children: list[subprocess.Popen], stopping: dict) -> None:
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for c in children:
        while c.poll() is None and time.monotonic() < deadline and stopping["n"] < 2:
            time.sleep(0.1)
        if c.poll() is None:
            c.kill()
            c.wait()


def cmd_transcribe(args: argparse.Namespace) -> int:
    from .text.subtitles import render
    from .wire.audio import AudioFileError, read_channels

    fmt = _output_format(args)
    if args.bitrate and args.codec != OPUS:
        raise CliError(EXIT_USAGE, "--bitrate goes with --codec opus")
    counted = (args.speakers, args.min_speakers, args.max_speakers)
    if any(n is not None for n in counted) and not args.diarize:
        raise CliError(EXIT_USAGE, "--speakers, --min-speakers and --max-speakers go with "
                                   "--diarize")
    source = sys.stdin.buffer if args.file == "-" else args.file
    try:
        streams, rate = read_channels(source, split=args.multichannel)
    except AudioFileError as exc:
        raise CliError(EXIT_INPUT, str(exc)) from None
    if not any(streams):
        raise CliError(EXIT_INPUT, f"{'standard input' if args.file == '-' else args.file} "
                                   "holds no audio")
    live = fmt is None or (args.output is not None and sys.stdout.isatty())
    display = _Display(args.json, quiet=not live)
    try:
        if args.multichannel:
            results = _stream_channels(args, streams, rate, display.show)
        else:
            results = [_stream(args, streams[0], rate, display.show)]
    finally:
        display.clear_partial()  # the next line starts where the partial began
    for result in results:
        _check_ended(args, result)
    if fmt is not None:
        per_channel = [_file_finals(args, list(result.finals)) for result in results]
        if args.multichannel:
            body = _render_channels(fmt, per_channel)
        else:
            body = render(fmt, per_channel[0])
        if args.output is None:
            sys.stdout.write(body)
            sys.stdout.flush()
        else:
            try:
                Path(args.output).write_text(body, encoding="utf-8")
            except OSError as exc:
                raise CliError(EXIT_FAILED, f"cannot write {args.output}: "
                                            f"{exc.strerror or exc}") from None
    return EXIT_OK


def _check_ended(args: argparse.Namespace, result) -> None:
    if result.fatal_errors:
        error = result.fatal_errors[-1]
        raise CliError(EXIT_FAILED, f"the stream ended with error {error.get('code')}")
    if not result.ended:
        raise CliError(EXIT_FAILED, f"no end of the stream within {args.timeout:g} s")


def _file_finals(args: argparse.Namespace, finals: list[dict]) -> list[dict]:
    """A stream's finals as the transcript file has them: with --diarize, labelled again
    from the whole file's speech at once (which labels better than live)."""
    if not args.diarize:
        return finals
    from .text.speakers import MAX_SPEAKERS, recluster
    low = args.speakers or args.min_speakers or 1
    high = args.speakers or args.max_speakers or MAX_SPEAKERS
    return recluster(finals, low, high)


def channel_label(channel: int, speaker: str | None = None) -> str:
    """A final's label in a --multichannel transcript: C1, C2, ... (C1-S2 with --diarize)."""
    return f"C{channel + 1}" + (f"-{speaker}" if speaker else "")


def _labelled(channel: int, final: dict) -> dict:
    words = [{**w, "speaker": channel_label(channel, w.get("speaker"))}
             for w in final.get("words") or []]
    return {**final, "speaker": channel_label(channel, final.get("speaker")),
            **({"words": words} if words else {})}


def _render_channels(fmt: str, per_channel: list[list[dict]]) -> str:
    """A --multichannel transcript: JSON has each channel's own; text and subtitles have
    every channel's finals in order of time, each labelled with its channel."""
    from .text.subtitles import render

    if fmt == "json":
        return json.dumps({"channels": [{"channel": c, **json.loads(render("json", finals))}
                                        for c, finals in enumerate(per_channel)]},
                          indent=1) + "\n"
    merged = sorted((_labelled(c, f) for c, finals in enumerate(per_channel) for f in finals),
                    key=lambda f: (f["start"], f["speaker"]))
    return render(fmt, merged)


def _stream_channels(args: argparse.Namespace, streams: list[bytes], rate: int, show):
    """Each channel through a session of its own, at once; their events shown labelled."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def shown(channel: int):
        def on_event(event: str, data: dict) -> None:
            if event == "text" and data.get("type") == "partial":
                return  # two partials cannot share one line
            if event == "text":
                data = {**data, "speaker": channel_label(channel, data.get("speaker"))}
            with lock:
                show(event, {**data, "channel": channel} if args.json else data)
        return on_event

    with ThreadPoolExecutor(max_workers=len(streams)) as pool:
        jobs = [pool.submit(_stream, args, pcm, rate, shown(c)) for c, pcm in enumerate(streams)]
        return [job.result() for job in jobs]


def _output_format(args: argparse.Namespace) -> str | None:
    """The transcript file's format; None: only the live view (or --json's events)."""
    if args.output_format is not None:
        fmt = args.output_format
    elif args.output is not None:
        suffix = Path(args.output).suffix.lower().lstrip(".")
        fmt = {"txt": "text", "json": "json", "srt": "srt", "vtt": "vtt"}.get(suffix, "text")
    elif args.json or sys.stdout.isatty():
        return None
    else:
        fmt = "text"  # piped: the transcript alone
    if args.json and args.output is None:
        raise CliError(EXIT_USAGE, "--json prints events on standard output: give the "
                                   "transcript a file with --output")
    return fmt


class _Display:
    """What ``transcribe`` shows of each event: JSON lines, or the live terminal view
    (partials rewritten in place on stderr, finals and their words on stdout)."""

    def __init__(self, as_json: bool, quiet: bool = False):
        self.as_json = as_json
        self.quiet = quiet  # no results (the transcript goes out as a file): what went wrong
        self.partial_len = 0

    def show(self, event: str, data: dict) -> None:
        if self.as_json:
            if event != "ack":  # a piece's voice vector is for the end's clustering
                shown = {k: v for k, v in data.items() if k != "voices"}
                print(json.dumps({"event": event, **shown}), flush=True)
        elif event == "text" and self.quiet:
            pass
        elif event == "text" and data["type"] == "partial":
            self._partial(data["text"])
        elif event == "text":
            self._final(data)
        elif event == "error":
            lost = data.get("lost")
            gone = f" (audio {lost[0]:.1f}-{lost[1]:.1f} s)" if lost else ""
            print(f"error {data.get('code')}: {data.get('msg')}{gone}", file=sys.stderr,
                  flush=True)
        elif event == "retry":
            print(f"the service is {data['code']}; trying again in {data['after_ms']} ms",
                  file=sys.stderr, flush=True)
        elif event in ("switch_down", "switch_up"):
            rung = (f"Opus {data.get('bitrate', 0) // 1000} kbit/s" if data.get("codec") == OPUS
                    else "PCM")
            why = "the link is slow" if event == "switch_down" else "the link has room"
            print(f"{why}: now sending {rung}", file=sys.stderr, flush=True)
        elif event == "relabel" and not self.quiet:
            print(f"(utterance {data['utterance']} was {data['speaker']})", flush=True)
        elif event == "session" and data.get("resumed"):
            print(f"reconnected; resuming at chunk {data['next_seq']}", file=sys.stderr,
                  flush=True)

    def _partial(self, text: str) -> None:
        line = f"  … {text}"
        pad = max(0, self.partial_len - len(line))
        sys.stderr.write("\r" + line + " " * pad)
        sys.stderr.flush()
        self.partial_len = len(line)

    def _final(self, data: dict) -> None:
        self.clear_partial()
        words = " ".join(f"{w['word']}[{w['start']:.2f}-{w['end']:.2f} {w['conf']:.2f}]"
                         for w in data.get("words", []))
        who = f"{data['speaker']}: " if data.get("speaker") else ""
        print(f"[{data['start']:7.2f} - {data['end']:7.2f}] {who}{data['text']}", flush=True)
        if words:
            print(f"    {words}", flush=True)

    def clear_partial(self) -> None:
        if self.partial_len:
            sys.stderr.write("\r" + " " * self.partial_len + "\r")
            self.partial_len = 0


def _stream(args: argparse.Namespace, pcm: bytes, rate: int, show):
    from .client import Refused, TranscribeError, Unreachable, transcribe_pcm

    try:
        return transcribe_pcm(args.url, pcm, rate, pace=args.pace, on_event=show,
                              timeout=args.timeout, token=args.token,
                              ssl_verify=not args.insecure, mode=args.mode,
                              codec=args.codec, bitrate=args.bitrate or 0, abr=args.abr,
                              language=args.language, script=args.script,
                              format=args.format, prompt=args.prompt,
                              diarize="file" if args.diarize else False,
                              speakers=args.speakers, min_speakers=args.min_speakers,
                              max_speakers=args.max_speakers)
    except Unreachable as exc:
        raise CliError(EXIT_UNREACHABLE, exc.msg) from None
    except Refused as exc:
        raise CliError(EXIT_REFUSED, f"the service refused the session: {exc.code}: "
                                     f"{exc.msg}") from None
    except TranscribeError as exc:
        raise CliError(EXIT_FAILED, exc.msg) from None

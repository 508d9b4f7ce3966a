"""``cosyvoice transcribe``: a file's audio through a cosyvoice service (the Socket.IO
client), shown live on a terminal or written as text, JSON, SRT or WebVTT."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from ..wire.codecs import OPUS
from .exits import (
    EXIT_FAILED,
    EXIT_INPUT,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)


def cmd_transcribe(args: argparse.Namespace) -> int:
    from ..text.subtitles import render
    from ..wire.audio import AudioFileError, read_channels

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
    from ..text.speakers import MAX_SPEAKERS, recluster
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
    from ..text.subtitles import render

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
    from ..client import Refused, TranscribeError, Unreachable, transcribe_pcm

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

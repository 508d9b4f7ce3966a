"""A session's finals as files: plain text, JSON, SRT and WebVTT.

The same rules as the page's downloads (cosyvoice/static/subtitles.mjs), so a file from
``cosyvoice transcribe --output-format srt`` and one from the page's "SRT" button cut
the same cues:

- **Text**: each final's text on its own line (finals without text are left out).
- **Cues**: a final's words, in order, filled into cues of at most ``MAX_LINES`` lines of
  ``LINE_CHARS`` characters (the common subtitle guideline) and at most ``MAX_CUE_S``
  seconds; a cue of two lines is cut where the lines are most even. A final in a language
  written without spaces (its ``language``: Chinese, Japanese, Thai, ...) is cut into lines
  of ``UNSPACED_LINE_CHARS`` characters (the guideline for CJK subtitles), its words
  (characters or tokens) joined without spaces; where its words no longer spell its text
  (a formatted final), its characters are the words. A cue runs from its
  first word's start to its last word's end: word times where the engine gives them (as
  many words as the final's text has), otherwise the final's own times shared out over its
  characters. Cues never overlap and never go backwards: a cue that would start before the
  previous one ends starts where it ends, and every cue lasts at least ``MIN_CUE_MS``.
- **JSON**: every final with its text, times, words (with their times and confidences),
  engine and language, the whole text (finals joined by a space, except between two in a
  language written without spaces) and the session's ``language`` (that of most finals).
- **WebVTT** says that language in its header (``Language: zh``); SRT has no header to say
  it in.
- **Speakers** (finals with ``speaker``, cosyvoice/text/speakers/): a cue never holds two
  speakers (words carry their own), and its first line starts with its speaker, ``[S1] ``
  in SRT and as a voice span, ``<v S1>``, in WebVTT (not counted in the line's length);
  text starts a paragraph, ``S1: ``, at each change of speaker (a blank line between);
  JSON lists the ``speakers`` in order of first appearance.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass

from ..wire.languages import join_texts, unspaced

LINE_CHARS = 42
UNSPACED_LINE_CHARS = 16
MAX_LINES = 2
MAX_CUE_S = 7.0
MIN_CUE_MS = 100
FORMATS = ("text", "json", "srt", "vtt")


@dataclass
class Cue:
    start_ms: int
    end_ms: int
    lines: list[str]
    speaker: str = ""


def _sep(final: dict) -> str:
    """What goes between two words of the final."""
    return "" if unspaced(final.get("language")) else " "


def timed_words(final: dict) -> list[tuple[str, float, float, str]]:
    """The final's text, a word at a time, with each word's start, end and speaker."""
    sep = _sep(final)
    words = [w for w in final.get("words") or [] if str(w.get("word", "")).strip()]
    if sep:
        tokens = final["text"].split()
        fits = len(words) == len(tokens)
    else:
        tokens = [str(w["word"]).strip() for w in words]
        fits = "".join(tokens) == "".join(final["text"].split())
        if not fits:
            tokens = list("".join(final["text"].split()))
    speaker = str(final.get("speaker") or "")
    if fits:
        return [(tok, float(w["start"]), float(w["end"]), str(w.get("speaker") or speaker))
                for tok, w in zip(tokens, words, strict=True)]
    start, end = float(final["start"]), float(final["end"])
    total = sum(len(t) + len(sep) for t in tokens)
    out, pos = [], 0
    for tok in tokens:
        s = start + (end - start) * pos / total
        pos += len(tok) + len(sep)
        out.append((tok, s, start + (end - start) * pos / total, speaker))
    return out


def wrap(tokens: list[str], width: int = LINE_CHARS, sep: str = " ") -> list[str]:
    """Tokens as subtitle lines of at most ``width`` characters: one line if they fit,
    else two of the most even lengths, else (a cue too long for two) filled greedily."""
    text = sep.join(tokens)
    if len(text) <= width:
        return [text]
    best: tuple[int, list[str]] | None = None
    for k in range(1, len(tokens)):
        first, second = sep.join(tokens[:k]), sep.join(tokens[k:])
        if len(first) <= width and len(second) <= width:
            score = abs(len(first) - len(second))
            if best is None or score < best[0]:
                best = (score, [first, second])
    if best is not None:
        return best[1]
    lines: list[str] = []
    for tok in tokens:
        if lines and len(lines[-1]) + len(sep) + len(tok) <= width:
            lines[-1] += sep + tok
        else:
            lines.append(tok)
    return lines


def cues(finals: list[dict]) -> list[Cue]:
    out: list[Cue] = []
    for final in finals:
        if not final.get("text", "").strip():
            continue
        sep = _sep(final)
        width = UNSPACED_LINE_CHARS if not sep else LINE_CHARS
        group: list[tuple[str, float, float, str]] = []
        for word in timed_words(final):
            candidate = group + [word]
            if group and (len(wrap([w[0] for w in candidate], width, sep)) > MAX_LINES
                          or candidate[-1][2] - candidate[0][1] > MAX_CUE_S
                          or word[3] != group[0][3]):
                out.append(_cue(group, width, sep))
                group = [word]
            else:
                group = candidate
        if group:
            out.append(_cue(group, width, sep))
    last_end = 0
    for cue in out:  # in order, never overlapping
        cue.start_ms = max(cue.start_ms, last_end)
        cue.end_ms = max(cue.end_ms, cue.start_ms + MIN_CUE_MS)
        last_end = cue.end_ms
    return out


def _ms(seconds: float) -> int:
    return math.floor(seconds * 1000 + 0.5)  # half up, as the page's Math.round


def _cue(group: list[tuple[str, float, float, str]], width: int, sep: str) -> Cue:
    return Cue(_ms(group[0][1]), _ms(group[-1][2]), wrap([w[0] for w in group], width, sep),
               group[0][3])


def _lines(cue: Cue, prefix: str) -> str:
    """The cue's lines, the first after its speaker's ``prefix`` (where it has one)."""
    lines = list(cue.lines)
    if cue.speaker:
        lines[0] = prefix.format(cue.speaker) + lines[0]
    return "\n".join(lines)


def _clock(ms: int, sep: str) -> str:
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_text(finals: list[dict]) -> str:
    out, speaker = "", None
    for f in finals:
        text = f.get("text", "").strip()
        if not text:
            continue
        if f.get("speaker") and f["speaker"] != speaker:
            out += ("\n" if speaker is not None else "") + f"{f['speaker']}: "
            speaker = f["speaker"]
        out += text + "\n"
    return out


def speakers(finals: list[dict]) -> list[str]:
    """The speakers of the finals with text, in order of first appearance."""
    return list(dict.fromkeys(f["speaker"] for f in finals
                              if f.get("text", "").strip() and f.get("speaker")))


def to_srt(finals: list[dict]) -> str:
    return "".join(f"{i}\n{_clock(c.start_ms, ',')} --> {_clock(c.end_ms, ',')}\n"
                   + _lines(c, "[{}] ") + "\n\n" for i, c in enumerate(cues(finals), 1))


def language(finals: list[dict]) -> str:
    """The language of most finals with text ("" where none says one; the first of a tie)."""
    counts = Counter(f["language"] for f in finals
                     if f.get("text", "").strip() and f.get("language"))
    return counts.most_common(1)[0][0] if counts else ""


def to_vtt(finals: list[dict]) -> str:
    lang = language(finals)
    header = f"WEBVTT\nLanguage: {lang}\n\n" if lang else "WEBVTT\n\n"
    return header + "".join(
        f"{_clock(c.start_ms, '.')} --> {_clock(c.end_ms, '.')}\n" + _lines(c, "<v {}>")
        + "\n\n" for c in cues(finals))


def to_json(finals: list[dict]) -> str:
    kept = [{k: v for k, v in f.items() if k not in ("type", "voices")} for f in finals
            if f.get("text", "").strip()]
    text = join_texts([f["text"].strip() for f in kept], [f.get("language") for f in kept])
    whole: dict = {"text": text, "language": language(finals)}
    who = speakers(finals)
    if who:
        whole["speakers"] = who
    return json.dumps({**whole, "finals": kept}, indent=1) + "\n"


def render(fmt: str, finals: list[dict]) -> str:
    return {"text": to_text, "json": to_json, "srt": to_srt, "vtt": to_vtt}[fmt](finals)

// A recording's finals as files: plain text, SRT and WebVTT. The same rules as
// cosyvoice/subtitles.py (`cosyvoice transcribe --output-format`), so the page and the
// command line cut the same cues (tests/unit/test_page_js.py compares them):
// each final's text a line; cues of at most two lines of 42 characters and 7 s, a
// two-line cue cut where its lines are most even, timed by word times where the engine
// gives them (the final's times shared out over its characters otherwise), in order and
// never overlapping, each at least 100 ms long. A final in a language written without
// spaces (Chinese, Japanese, Thai, ...) is cut into lines of 16 characters, its words
// joined without spaces (its characters where the words no longer spell its text); WebVTT
// names the language of most finals in its header. With speaker labels a cue never holds
// two speakers and starts with its speaker (`[S1] ` in SRT, `<v S1>` in WebVTT), and text
// starts a paragraph, `S1: `, at each change of speaker.

export const LINE_CHARS = 42;
export const UNSPACED_LINE_CHARS = 16;
// cosyvoice/languages.py UNSPACED
export const UNSPACED = new Set(["zh", "ja", "th", "lo", "my"]);
export const MAX_LINES = 2;
export const MAX_CUE_S = 7.0;
export const MIN_CUE_MS = 100;

function hasText(final) {
  return Boolean((final.text ?? "").trim());
}

/** Whether a result is in a language written without spaces between words. */
export function unspaced(result) {
  return UNSPACED.has(result?.language ?? "");
}

function separator(final) {
  return unspaced(final) ? "" : " ";
}

/** What goes between two finals of a transcript: a space, except between two in
 * languages written without spaces (cosyvoice/languages.py join_texts). */
export function joiner(before, after) {
  return unspaced(before) && unspaced(after) ? "" : " ";
}

/** A final's words as the page and the files show them: `sep` between them, its
 * `tokens`, its timed `words`, and whether those words spell the tokens (`fits`); in a
 * language written without spaces whose words no longer spell its text (a formatted
 * final), its characters are the tokens. */
export function wordsOf(final) {
  const sep = separator(final);
  const words = (final.words ?? []).filter((w) => String(w.word ?? "").trim());
  const spelled = final.text.split(/\s+/).filter(Boolean);
  if (sep) return { sep, tokens: spelled, words, fits: words.length === spelled.length };
  const tokens = words.map((w) => String(w.word).trim());
  const chars = spelled.join("");
  if (tokens.join("") === chars) return { sep, tokens, words, fits: true };
  return { sep, tokens: Array.from(chars), words, fits: false };
}

function timedWords(final) {
  const { sep, tokens, words, fits } = wordsOf(final);
  const speaker = String(final.speaker ?? "");
  if (fits) {
    return tokens.map((tok, i) => [tok, Number(words[i].start), Number(words[i].end),
      String(words[i].speaker ?? speaker)]);
  }
  const start = Number(final.start);
  const end = Number(final.end);
  const total = tokens.reduce((n, t) => n + t.length + sep.length, 0);
  let pos = 0;
  return tokens.map((tok) => {
    const s = start + ((end - start) * pos) / total;
    pos += tok.length + sep.length;
    return [tok, s, start + ((end - start) * pos) / total, speaker];
  });
}

/** Tokens as subtitle lines: one if they fit, else two of the most even lengths, else
 * filled greedily. */
export function wrap(tokens, width = LINE_CHARS, sep = " ") {
  const text = tokens.join(sep);
  if (text.length <= width) return [text];
  let best = null;
  for (let k = 1; k < tokens.length; k++) {
    const first = tokens.slice(0, k).join(sep);
    const second = tokens.slice(k).join(sep);
    if (first.length <= width && second.length <= width) {
      const score = Math.abs(first.length - second.length);
      if (best === null || score < best[0]) best = [score, [first, second]];
    }
  }
  if (best !== null) return best[1];
  const lines = [];
  for (const tok of tokens) {
    if (lines.length && lines[lines.length - 1].length + sep.length + tok.length <= width) {
      lines[lines.length - 1] += sep + tok;
    } else {
      lines.push(tok);
    }
  }
  return lines;
}

function cue(group, width, sep) {
  return {
    startMs: Math.round(group[0][1] * 1000),
    endMs: Math.round(group[group.length - 1][2] * 1000),
    lines: wrap(group.map((w) => w[0]), width, sep),
    speaker: group[0][3],
  };
}

function cueLines(c, prefix) {
  const lines = [...c.lines];
  if (c.speaker) lines[0] = prefix(c.speaker) + lines[0];
  return lines.join("\n");
}

export function cues(finals) {
  const out = [];
  for (const final of finals) {
    if (!hasText(final)) continue;
    const sep = separator(final);
    const width = sep ? LINE_CHARS : UNSPACED_LINE_CHARS;
    let group = [];
    for (const word of timedWords(final)) {
      const candidate = [...group, word];
      if (group.length && (wrap(candidate.map((w) => w[0]), width, sep).length > MAX_LINES
          || candidate[candidate.length - 1][2] - candidate[0][1] > MAX_CUE_S
          || word[3] !== group[0][3])) {
        out.push(cue(group, width, sep));
        group = [word];
      } else {
        group = candidate;
      }
    }
    if (group.length) out.push(cue(group, width, sep));
  }
  let lastEnd = 0;
  for (const c of out) {
    c.startMs = Math.max(c.startMs, lastEnd);
    c.endMs = Math.max(c.endMs, c.startMs + MIN_CUE_MS);
    lastEnd = c.endMs;
  }
  return out;
}

function clock(ms, sep) {
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  const h = Math.floor(ms / 3600000);
  const m = Math.floor((ms % 3600000) / 60000);
  const s = Math.floor((ms % 60000) / 1000);
  return `${pad(h)}:${pad(m)}:${pad(s)}${sep}${pad(ms % 1000, 3)}`;
}

export function toText(finals) {
  let out = "";
  let speaker = null;
  for (const f of finals.filter(hasText)) {
    if (f.speaker && f.speaker !== speaker) {
      out += `${speaker !== null ? "\n" : ""}${f.speaker}: `;
      speaker = f.speaker;
    }
    out += `${f.text.trim()}\n`;
  }
  return out;
}

export function toSrt(finals) {
  return cues(finals).map((c, i) => `${i + 1}\n${clock(c.startMs, ",")} --> ${clock(c.endMs, ",")}\n`
    + `${cueLines(c, (who) => `[${who}] `)}\n\n`).join("");
}

/** The language of most finals with text ("" where none says one; the first of a tie). */
export function language(finals) {
  const counts = new Map();
  for (const f of finals) {
    if (hasText(f) && f.language) counts.set(f.language, (counts.get(f.language) ?? 0) + 1);
  }
  let best = "";
  let most = 0;
  for (const [lang, n] of counts) {
    if (n > most) [best, most] = [lang, n];
  }
  return best;
}

export function toVtt(finals) {
  const lang = language(finals);
  return (lang ? `WEBVTT\nLanguage: ${lang}\n\n` : "WEBVTT\n\n") + cues(finals).map((c) => `${clock(c.startMs, ".")} --> ${clock(c.endMs, ".")}\n`
    + `${cueLines(c, (who) => `<v ${who}>`)}\n\n`).join("");
}

// A recording's finals as files: plain text, SRT and WebVTT. The same rules as
// cosyvoice/subtitles.py (`cosyvoice transcribe --output-format`), so the page and the
// command line cut the same cues (tests/unit/test_page_js.py compares them):
// each final's text a line; cues of at most two lines of 42 characters and 7 s, a
// two-line cue cut where its lines are most even, timed by word times where the engine
// gives them (the final's times shared out over its characters otherwise), in order and
// never overlapping, each at least 100 ms long.

export const LINE_CHARS = 42;
export const MAX_LINES = 2;
export const MAX_CUE_S = 7.0;
export const MIN_CUE_MS = 100;

function hasText(final) {
  return Boolean((final.text ?? "").trim());
}

function timedWords(final) {
  const tokens = final.text.split(/\s+/).filter(Boolean);
  const words = (final.words ?? []).filter((w) => String(w.word ?? "").trim());
  if (words.length === tokens.length) {
    return tokens.map((tok, i) => [tok, Number(words[i].start), Number(words[i].end)]);
  }
  const start = Number(final.start);
  const end = Number(final.end);
  const total = tokens.reduce((n, t) => n + t.length + 1, 0);
  let pos = 0;
  return tokens.map((tok) => {
    const s = start + ((end - start) * pos) / total;
    pos += tok.length + 1;
    return [tok, s, start + ((end - start) * pos) / total];
  });
}

/** Tokens as subtitle lines: one if they fit, else two of the most even lengths, else
 * filled greedily. */
export function wrap(tokens, width = LINE_CHARS) {
  const text = tokens.join(" ");
  if (text.length <= width) return [text];
  let best = null;
  for (let k = 1; k < tokens.length; k++) {
    const first = tokens.slice(0, k).join(" ");
    const second = tokens.slice(k).join(" ");
    if (first.length <= width && second.length <= width) {
      const score = Math.abs(first.length - second.length);
      if (best === null || score < best[0]) best = [score, [first, second]];
    }
  }
  if (best !== null) return best[1];
  const lines = [];
  for (const tok of tokens) {
    if (lines.length && lines[lines.length - 1].length + 1 + tok.length <= width) {
      lines[lines.length - 1] += ` ${tok}`;
    } else {
      lines.push(tok);
    }
  }
  return lines;
}

function cue(group) {
  return {
    startMs: Math.round(group[0][1] * 1000),
    endMs: Math.round(group[group.length - 1][2] * 1000),
    lines: wrap(group.map((w) => w[0])),
  };
}

export function cues(finals) {
  const out = [];
  for (const final of finals) {
    if (!hasText(final)) continue;
    let group = [];
    for (const word of timedWords(final)) {
      const candidate = [...group, word];
      if (group.length && (wrap(candidate.map((w) => w[0])).length > MAX_LINES
          || candidate[candidate.length - 1][2] - candidate[0][1] > MAX_CUE_S)) {
        out.push(cue(group));
        group = [word];
      } else {
        group = candidate;
      }
    }
    if (group.length) out.push(cue(group));
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
  return finals.filter(hasText).map((f) => `${f.text.trim()}\n`).join("");
}

export function toSrt(finals) {
  return cues(finals).map((c, i) => `${i + 1}\n${clock(c.startMs, ",")} --> ${clock(c.endMs, ",")}\n`
    + `${c.lines.join("\n")}\n\n`).join("");
}

export function toVtt(finals) {
  return "WEBVTT\n\n" + cues(finals).map((c) => `${clock(c.startMs, ".")} --> ${clock(c.endMs, ".")}\n`
    + `${c.lines.join("\n")}\n\n`).join("");
}

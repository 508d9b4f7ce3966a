// The transcript on the page: final results appended, the current partial greyed and
// replaced in place, word times and confidence on every final word, and the engine that
// produced each final. With speaker labels each speaker's turn starts a paragraph with
// its label, in a colour of its own (speaker-1 … speaker-8, then again), and a `relabel`
// moves an earlier final to another speaker. The finals are kept for the downloads (subtitles.mjs): the page
// shows each final's own text, so a downloaded file says what the page says.

import { joiner, wordsOf } from "./subtitles.mjs";

const LOW_CONFIDENCE = 0.5;

function seconds(t) {
  return `${t.toFixed(2)} s`;
}

export class TranscriptView {
  /** `finals` is the live region that collects final text; `partial` shows the hypothesis. */
  constructor(finals, partial, placeholder) {
    this.finals = finals;
    this.partial = partial;
    this.placeholder = placeholder;
    this.results = []; // the finals with text, in order
  }

  /** The hypothesis of utterance `utterance` so far (and its likely speaker). */
  showPartial(text, utterance, speaker) {
    this.partial.textContent = text ? ` ${text}` : "";
    this.partialUtterance = utterance;
    if (speaker) this.partial.dataset.speaker = speaker;
    else delete this.partial.dataset.speaker;
    this.update();
  }

  /** A final's speaker, as a class and a label at the start of each turn. */
  paintSpeaker(segment, speaker) {
    segment.dataset.speaker = speaker;
    const n = Number(speaker.slice(1)) || 1;
    for (const c of [...segment.classList]) if (c.startsWith("speaker-")) segment.classList.remove(c);
    segment.classList.add(`speaker-${((n - 1) % 8) + 1}`);
  }

  /** Each turn (a run of finals of one speaker) starts on a line of its own with the
   * speaker's label. */
  markTurns() {
    for (const br of this.finals.querySelectorAll("br.turn-break")) br.remove();
    let previous = null;
    for (const segment of this.finals.querySelectorAll(".segment")) {
      const speaker = segment.dataset.speaker ?? null;
      const turn = Boolean(speaker) && speaker !== previous;
      segment.classList.toggle("turn", turn);
      if (turn && previous !== null) {
        const br = document.createElement("br");
        br.className = "turn-break";
        segment.before(br);
      }
      previous = speaker;
    }
  }

  /** A later final says an earlier one was said by `speaker` (and, where `spans`
   * [start, end, speaker] are given, each of its words by the span holding its middle). */
  relabel(utterance, speaker, spans) {
    for (const r of this.results) {
      if (r.utterance !== utterance) continue;
      r.speaker = speaker;
      for (const w of r.words ?? []) {
        const mid = (Number(w.start) + Number(w.end)) / 2;
        const span = (spans ?? []).find(([a, b]) => a <= mid && mid <= b);
        w.speaker = span ? span[2] : speaker;
      }
    }
    for (const segment of this.finals.querySelectorAll(`.segment[data-utterance="${utterance}"]`)) {
      this.paintSpeaker(segment, speaker);
    }
    this.markTurns();
  }

  /** A final replaces its own utterance's partial. Whisper finals come after the next
   * utterance's partials have begun: those stay. */
  addFinal(result) {
    if (this.partialUtterance === undefined || this.partialUtterance <= result.utterance) {
      this.partial.textContent = "";
    }
    const text = (result.text ?? "").trim();
    if (!text) {
      this.update();
      return;
    }
    this.results.push(result);
    const { sep, tokens, words, fits } = wordsOf({ ...result, text });
    const segment = document.createElement("span");
    segment.className = "segment";
    const engine = result.engine ? ` · ${result.engine}` : "";
    segment.title = `${seconds(result.start)} – ${seconds(result.end)}${engine}`;
    if (result.engine) segment.dataset.engine = result.engine;
    if (result.language) segment.lang = result.language;
    segment.dataset.utterance = String(result.utterance);
    if (result.speaker) this.paintSpeaker(segment, result.speaker);
    if (fits) {
      // the final's words, each with its time and confidence
      tokens.forEach((token, i) => {
        const w = words[i];
        const span = document.createElement("span");
        span.className = "word";
        if (w.conf < LOW_CONFIDENCE) span.classList.add("low");
        const confidence = `${Math.round(w.conf * 100)}%`;
        span.title = `${token}: ${seconds(w.start)}–${seconds(w.end)}, confidence ${confidence}`;
        span.dataset.detail = `${seconds(w.start)} · ${confidence}`;
        span.textContent = token;
        segment.append(i ? sep : "", span);
      });
    } else {
      segment.textContent = text;
    }
    const glue = joiner(this.results[this.results.length - 2], result);
    if (this.finals.childElementCount && glue) this.finals.append(glue);
    this.finals.append(segment);
    if (result.speaker) this.markTurns();
    this.update();
  }

  clear() {
    this.results = [];
    this.finals.replaceChildren();
    this.partial.textContent = "";
    this.partialUtterance = undefined;
    this.update();
  }

  /** The transcript as the page shows it (the engine tags are the stylesheet's). */
  text() {
    return this.results.reduce(
      (out, r, i) => out + (i ? joiner(this.results[i - 1], r) : "") + r.text.trim(), "");
  }

  update() {
    this.placeholder.hidden = Boolean(this.finals.childElementCount || this.partial.textContent);
  }
}

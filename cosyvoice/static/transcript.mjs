// The transcript on the page: final results appended, the current partial greyed and
// replaced in place, word times and confidence on every final word, and the engine that
// produced each final. The finals are kept for the downloads (subtitles.mjs): the page
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

  /** The hypothesis of utterance `utterance` so far. */
  showPartial(text, utterance) {
    this.partial.textContent = text ? ` ${text}` : "";
    this.partialUtterance = utterance;
    this.update();
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

// The transcript on the page: final results appended, the current partial greyed and
// replaced in place, word times and confidence on every final word.

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
    const words = (result.words ?? []).filter((w) => w.word);
    if (!result.text && !words.length) {
      this.update();
      return;
    }
    const segment = document.createElement("span");
    segment.className = "segment";
    segment.title = `${seconds(result.start)} – ${seconds(result.end)}`;
    if (words.length) {
      words.forEach((w, i) => {
        const span = document.createElement("span");
        span.className = "word";
        if (w.conf < LOW_CONFIDENCE) span.classList.add("low");
        const confidence = `${Math.round(w.conf * 100)}%`;
        span.title = `${w.word}: ${seconds(w.start)}–${seconds(w.end)}, confidence ${confidence}`;
        span.dataset.detail = `${seconds(w.start)} · ${confidence}`;
        span.textContent = w.word;
        segment.append(i ? " " : "", span);
      });
    } else {
      segment.textContent = result.text;
    }
    if (this.finals.childElementCount) this.finals.append(" ");
    this.finals.append(segment);
    this.update();
  }

  clear() {
    this.finals.replaceChildren();
    this.partial.textContent = "";
    this.partialUtterance = undefined;
    this.update();
  }

  text() {
    return this.finals.textContent.trim();
  }

  update() {
    this.placeholder.hidden = Boolean(this.finals.childElementCount || this.partial.textContent);
  }
}

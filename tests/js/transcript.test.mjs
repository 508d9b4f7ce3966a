// The transcript view (transcript.mjs) on a minimal stand-in for the DOM (named as such:
// Node has no document; the browser tests run the real page in Chromium).

import assert from "node:assert/strict";
import { test } from "node:test";

class FakeElement {
  constructor() {
    this.children = [];
    this.textContent = "";
    this.dataset = {};
    this.classList = { add() {} };
    this.hidden = false;
  }
  get childElementCount() {
    return this.children.filter((c) => typeof c !== "string").length;
  }
  append(...items) {
    this.children.push(...items);
  }
  replaceChildren() {
    this.children = [];
  }
}

globalThis.document = { createElement: () => new FakeElement() };
const { TranscriptView } = await import("../../cosyvoice/static/transcript.mjs");

function view() {
  return new TranscriptView(new FakeElement(), new FakeElement(), new FakeElement());
}

test("a final replaces the partial of its own utterance", () => {
  const v = view();
  v.showPartial("the weather is", 0);
  v.addFinal({ utterance: 0, text: "The weather is nice today.", start: 0, end: 2 });
  assert.equal(v.partial.textContent, "");
  assert.equal(v.finals.childElementCount, 1);
});

test("a late final leaves the next utterance's partial on screen", () => {
  const v = view();
  v.showPartial("the weather is nice", 0);
  v.showPartial("please call", 1); // utterance 1 began; 0's Whisper final is still coming
  v.addFinal({ utterance: 0, text: "The weather is nice today.", start: 0, end: 2 });
  assert.equal(v.partial.textContent, " please call");
  v.addFinal({ utterance: 1, text: "Please call me back.", start: 3, end: 5 });
  assert.equal(v.partial.textContent, "");
  assert.equal(v.finals.childElementCount, 2);
});

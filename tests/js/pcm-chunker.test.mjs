// The browser page's capture arithmetic under Node's test runner: exact 200 ms chunks,
// a band-limited resampler that does not drift, and rate switches at chunk boundaries.

import assert from "node:assert/strict";
import { test } from "node:test";

import { PcmChunker, Resampler, downmix, toInt16 } from "../../cosyvoice/static/pcm-chunker.mjs";

const RENDER_QUANTUM = 128; // frames per AudioWorklet process() call

function sine(rate, seconds, freq, amp = 0.5, phase = 0) {
  const n = Math.round(rate * seconds);
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) x[i] = amp * Math.sin(2 * Math.PI * freq * i / rate + phase);
  return x;
}

// Feeds `signal` the way the worklet does (128-frame blocks), then flushes.
function capture(chunker, channels, onBlock = () => {}) {
  const chunks = [];
  for (let i = 0, block = 0; i < channels[0].length; i += RENDER_QUANTUM, block++) {
    onBlock(block, chunker);
    chunks.push(...chunker.push(channels.map((ch) => ch.subarray(i, i + RENDER_QUANTUM))));
  }
  chunks.push(...chunker.flush());
  return chunks;
}

function concat(chunks) {
  const total = chunks.reduce((n, c) => n + c.pcm.length, 0);
  const out = new Int16Array(total);
  let at = 0;
  for (const c of chunks) {
    out.set(c.pcm, at);
    at += c.pcm.length;
  }
  return out;
}

// Signal-to-error ratio in dB of `got` (int16) against the ideal float signal.
function snrDb(got, ideal, from, to) {
  let sig = 0;
  let err = 0;
  for (let i = from; i < to; i++) {
    const g = got[i] / 32768;
    sig += ideal[i] ** 2;
    err += (g - ideal[i]) ** 2;
  }
  return 10 * Math.log10(sig / err);
}

function rms(samples, from = 0, to = samples.length) {
  let s = 0;
  for (let i = from; i < to; i++) s += (samples[i] / 32768) ** 2;
  return Math.sqrt(s / (to - from));
}

for (const inRate of [44100, 48000]) {
  test(`${inRate} Hz input gives exact 200 ms / 6400-byte chunks at 16 kHz`, () => {
    const seconds = 10.05;
    const chunks = capture(new PcmChunker(inRate, 16000), [sine(inRate, seconds, 440)]);
    const full = chunks.slice(0, -1);
    assert.equal(full.length, 50);
    for (const c of full) {
      assert.equal(c.pcm.length, 3200);
      assert.equal(c.pcm.byteLength, 6400);
      assert.equal(c.sampleRate, 16000);
      assert.equal(c.last, false);
    }
    const last = chunks.at(-1);
    assert.equal(last.last, true);
    // Every input sample is accounted for: ceil(N * 16000 / inRate) output samples.
    const n = Math.round(inRate * seconds);
    assert.equal(concat(chunks).length, Math.ceil((n * 16000) / inRate));
    assert.equal(last.pcm.length, 800);
  });

  test(`${inRate} Hz -> 16 kHz keeps a 440 Hz tone clean and in phase after 60 s`, () => {
    const seconds = 60;
    const out = concat(capture(new PcmChunker(inRate, 16000), [sine(inRate, seconds, 440)]));
    const ideal = sine(16000, seconds, 440);
    // Skip the filter's edges; compare the last second too, where drift would show.
    assert.ok(snrDb(out, ideal, 1000, 16000) > 60);
    assert.ok(snrDb(out, ideal, out.length - 16000, out.length - 1000) > 60);
  });

  test(`${inRate} Hz -> 16 kHz removes content above the new Nyquist frequency`, () => {
    const out = concat(capture(new PcmChunker(inRate, 16000), [sine(inRate, 2, 11000, 0.9)]));
    assert.ok(rms(out, 2000, 30000) < 0.9 * 1e-3, "an 11 kHz tone must not alias into speech");
  });
}

test("a 1 s input at 48 kHz resampled to 16 kHz has its samples at the right times", () => {
  // A single click at input sample 4800 (100 ms) lands on output sample 1600.
  const x = new Float32Array(48000);
  x[4800] = 1;
  const out = concat(capture(new PcmChunker(48000, 16000), [x]));
  let peak = 0;
  for (let i = 1; i < out.length; i++) if (out[i] > out[peak]) peak = i;
  assert.equal(peak, 1600);
});

test("stereo is averaged to mono", () => {
  const left = new Float32Array([0.5, 1, -1, 0]);
  const right = new Float32Array([0.5, 0, 1, -0.5]);
  assert.deepEqual(Array.from(downmix([left, right])), [0.5, 0.5, 0, -0.25]);
  const chunks = capture(new PcmChunker(16000, 16000), [sine(16000, 0.4, 300), sine(16000, 0.4, 300)]);
  assert.deepEqual(Array.from(concat(chunks)), Array.from(toInt16(sine(16000, 0.4, 300))));
});

test("float to int16 rounds and clips", () => {
  const got = toInt16(new Float32Array([0, 0.5, -0.5, 1, -1, 2, -2, 1 / 32768]));
  assert.deepEqual(Array.from(got), [0, 16384, -16384, 32767, -32768, 32767, -32768, 1]);
});

test("a rate switch applies at the next chunk boundary and keeps chunks at 200 ms", () => {
  const chunker = new PcmChunker(48000, 16000);
  const chunks = capture(chunker, [sine(48000, 3, 440)], (block) => {
    if (block === 400) chunker.setRate(8000); // ~1.07 s in, mid-chunk
    if (block === 800) chunker.setRate(48000);
  });
  const sizes = chunks.slice(0, -1).map((c) => [c.sampleRate, c.pcm.length]);
  const expected = [
    ...Array(6).fill([16000, 3200]), // 0 .. 1.2 s: the switch waits for the boundary
    ...Array(5).fill([8000, 1600]), // 1.2 .. 2.2 s
    ...Array(4).fill([48000, 9600]), // 2.2 .. 3.0 s
  ];
  assert.deepEqual(sizes, expected);
  assert.equal(chunks.at(-1).last, true);
  assert.equal(chunks.at(-1).pcm.length, 0);
  // The audio stays continuous across both switches: one second of 8 kHz output matches
  // the tone exactly where its time says it is.
  const at8k = concat(chunks.slice(6, 11));
  const ideal = sine(8000, 1, 440, 0.5, 2 * Math.PI * 440 * 1.2);
  assert.ok(snrDb(at8k, ideal, 0, at8k.length) > 50);
});

test("a switch down from a session at the device's own rate keeps the audio continuous", () => {
  const chunker = new PcmChunker(48000, 48000); // passthrough until the switch
  const chunks = capture(chunker, [sine(48000, 2, 440)], (block) => {
    if (block === 100) chunker.setRate(16000); // ~0.27 s in
  });
  assert.deepEqual(chunks.slice(0, 3).map((c) => [c.sampleRate, c.pcm.length]),
                   [[48000, 9600], [48000, 9600], [16000, 3200]]);
  const after = concat(chunks.slice(2, -1));
  const ideal = sine(16000, 1.6, 440, 0.5, 2 * Math.PI * 440 * 0.4);
  assert.ok(snrDb(after, ideal, 0, after.length) > 50);
});

test("flush right after a chunk boundary sends an empty last chunk", () => {
  const chunks = capture(new PcmChunker(16000, 16000), [new Float32Array(6400)]);
  assert.deepEqual(chunks.map((c) => [c.pcm.length, c.last]), [[3200, false], [3200, false], [0, true]]);
});

test("the resampler never drifts: output count follows the exact rate ratio", () => {
  const r = new Resampler(44100, 16000);
  const out = new Float32Array(4096);
  let produced = 0;
  const block = new Float32Array(RENDER_QUANTUM);
  const blocks = Math.ceil((44100 * 600) / RENDER_QUANTUM); // ten minutes
  for (let b = 0; b < blocks; b++) {
    r.write(block);
    for (let got; (got = r.read(out)) > 0;) produced += got;
  }
  r.end();
  for (let got; (got = r.read(out)) > 0;) produced += got;
  assert.equal(produced, Math.ceil((blocks * RENDER_QUANTUM * 16000) / 44100));
});

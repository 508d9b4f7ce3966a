// The capture pipeline's arithmetic: downmix to mono, resample, convert to 16-bit PCM
// and cut exact 200 ms chunks. No Web API in here, so the audio worklet and Node's test
// runner load the same code.

export const CHUNK_MS = 200;

// Zero crossings of the sinc kernel on each side: ~90 dB stop band with the window below.
const ZERO_CROSSINGS = 16;
// Passband edge as a fraction of the lower Nyquist frequency (speech lives well below).
const ROLLOFF = 0.94;
// Kaiser window shape: ~80 dB side lobes.
const KAISER_BETA = 8.6;
// Input samples kept behind the read position, so a rate switch never lacks history.
const HISTORY = 1024;
// Polyphase tables with more phases than this are not built; taps are computed per sample.
const MAX_TABLE_PHASES = 4096;

function gcd(a, b) {
  while (b) [a, b] = [b, a % b];
  return a;
}

// Zeroth-order modified Bessel function of the first kind, for the Kaiser window.
function besselI0(x) {
  let sum = 1;
  let term = 1;
  for (let k = 1; k < 50; k++) {
    term *= (x / (2 * k)) ** 2;
    sum += term;
    if (term < sum * 1e-12) break;
  }
  return sum;
}

/** Average of the channels: the mono signal the service expects. */
export function downmix(channels) {
  if (channels.length === 1) return channels[0];
  const n = channels[0].length;
  const mono = new Float32Array(n);
  for (const ch of channels) {
    for (let i = 0; i < n; i++) mono[i] += ch[i];
  }
  const scale = 1 / channels.length;
  for (let i = 0; i < n; i++) mono[i] *= scale;
  return mono;
}

/** Float samples in [-1, 1] to little-endian-ready signed 16-bit integers. */
export function toInt16(samples, out = new Int16Array(samples.length), offset = 0, count = samples.length) {
  for (let i = 0; i < count; i++) {
    const v = Math.round(samples[i] * 32768);
    out[offset + i] = v > 32767 ? 32767 : v < -32768 ? -32768 : v;
  }
  return out;
}

/**
 * Streaming band-limited resampler (Kaiser-windowed sinc, polyphase).
 *
 * Output sample n sits exactly at input position n * inRate / outRate: the position is
 * kept as an integer plus a rational phase, so no rounding drifts over a long stream.
 * Write input with `write`, take what is computable with `read`; `end` pads the stream
 * with silence so `read` returns the rest.
 */
export class Resampler {
  constructor(inRate, outRate) {
    this.inRate = inRate;
    this.buf = new Float32Array(8192);
    this.len = 0;
    this.pos = 0; // integer input position of the next output, as an index into buf
    this.phase = 0; // fractional part of that position, in units of 1 / this.up
    this.ended = -1; // buf index where the real input ends, once `end` was called
    this.configure(outRate);
  }

  /** Changes the output rate from the next output sample on, keeping the input history. */
  configure(outRate) {
    const oldUp = this.up;
    this.outRate = outRate;
    const g = gcd(this.inRate, outRate);
    this.up = outRate / g;
    this.down = this.inRate / g;
    if (oldUp) {
      this.phase = Math.round((this.phase * this.up) / oldUp);
      if (this.phase >= this.up) {
        this.pos += 1;
        this.phase -= this.up;
      }
    }
    this.passthrough = this.inRate === outRate;
    const cutoff = 0.5 * Math.min(1, outRate / this.inRate) * ROLLOFF; // cycles per input sample
    this.cutoff = cutoff;
    this.half = this.passthrough ? 0 : Math.ceil(ZERO_CROSSINGS / (2 * cutoff));
    this.table = null;
    if (!this.passthrough && this.up <= MAX_TABLE_PHASES) {
      this.table = [];
      for (let p = 0; p < this.up; p++) this.table.push(this.taps(p));
    }
    // Before any input, start with `half` samples of silence behind the first sample.
    if (this.len === 0) {
      this.len = this.half;
      this.pos = this.half;
      this.buf.fill(0, 0, this.len);
    } else if (this.pos < this.half) {
      this.prependSilence(this.half - this.pos);
    }
  }

  // Kernel weights for phase p over input samples pos-half+1 .. pos+half, summing to 1.
  taps(p) {
    const n = 2 * this.half;
    const w = new Float32Array(n);
    const frac = p / this.up;
    const norm = besselI0(KAISER_BETA);
    let sum = 0;
    for (let j = 0; j < n; j++) {
      const d = frac + this.half - 1 - j; // distance from output position to the input sample
      const x = 2 * this.cutoff * d;
      const sinc = x === 0 ? 1 : Math.sin(Math.PI * x) / (Math.PI * x);
      const r = d / (this.half + 1);
      const win = Math.abs(r) >= 1 ? 0 : besselI0(KAISER_BETA * Math.sqrt(1 - r * r)) / norm;
      w[j] = sinc * win;
      sum += w[j];
    }
    for (let j = 0; j < n; j++) w[j] /= sum;
    return w;
  }

  prependSilence(count) {
    this.reserve(count);
    this.buf.copyWithin(count, 0, this.len);
    this.buf.fill(0, 0, count);
    this.len += count;
    this.pos += count;
    if (this.ended >= 0) this.ended += count;
  }

  reserve(extra) {
    if (this.len + extra <= this.buf.length) return;
    const keepFrom = Math.max(0, this.pos - Math.max(this.half, HISTORY));
    if (keepFrom > 0) {
      this.buf.copyWithin(0, keepFrom, this.len);
      this.len -= keepFrom;
      this.pos -= keepFrom;
      if (this.ended >= 0) this.ended -= keepFrom;
    }
    if (this.len + extra > this.buf.length) {
      const grown = new Float32Array(Math.max(this.buf.length * 2, this.len + extra));
      grown.set(this.buf.subarray(0, this.len));
      this.buf = grown;
    }
  }

  write(samples) {
    if (this.ended >= 0) throw new Error("write after end");
    this.reserve(samples.length);
    this.buf.set(samples, this.len);
    this.len += samples.length;
  }

  /** Marks the end of input: the remaining output is computed against silence. */
  end() {
    if (this.ended >= 0) return;
    this.ended = this.len;
    const pad = this.half + 1;
    this.reserve(pad);
    this.buf.fill(0, this.len, this.len + pad);
    this.len += pad;
  }

  /** Writes up to `max` output samples into `out` from index 0; returns how many. */
  read(out, max = out.length) {
    let n = 0;
    const limit = this.ended >= 0 ? this.ended : this.len - this.half;
    const buf = this.buf;
    while (n < max && this.pos < limit) {
      if (this.passthrough) {
        out[n++] = buf[this.pos++];
        continue;
      }
      const w = this.table ? this.table[this.phase] : this.taps(this.phase);
      const base = this.pos - this.half + 1;
      let acc = 0;
      for (let j = 0; j < w.length; j++) acc += buf[base + j] * w[j];
      out[n++] = acc;
      this.phase += this.down;
      if (this.phase >= this.up) {
        this.pos += Math.floor(this.phase / this.up);
        this.phase %= this.up;
      }
    }
    return n;
  }
}

/**
 * Turns captured audio into the chunks the service takes: 16-bit mono PCM at the
 * session's rate, exactly `chunkMs` each, the last one (at `flush`) holding the rest.
 *
 * A rate change (`setRate`) takes effect at the next chunk boundary, so every chunk
 * holds audio at one rate and stays exactly `chunkMs` long.
 */
export class PcmChunker {
  constructor(inputRate, outputRate, chunkMs = CHUNK_MS) {
    this.chunkMs = chunkMs;
    this.resampler = new Resampler(inputRate, outputRate);
    this.pendingRate = null;
    this.finished = false;
    this.startChunk(outputRate);
  }

  get rate() {
    return this.resampler.outRate;
  }

  startChunk(rate) {
    if (rate !== this.resampler.outRate) this.resampler.configure(rate);
    this.size = Math.round((rate * this.chunkMs) / 1000);
    this.pcm = new Int16Array(this.size);
    this.fill = 0;
    this.scratch = new Float32Array(this.size);
  }

  /** Asks for a new output rate; it applies from the next chunk on. */
  setRate(rate) {
    if (this.fill === 0) {
      this.pendingRate = null;
      this.startChunk(rate);
    } else {
      this.pendingRate = rate;
    }
  }

  /** Feeds one block of captured audio (one Float32Array per channel); returns full chunks. */
  push(channels) {
    if (this.finished) return [];
    this.resampler.write(downmix(channels));
    return this.drain();
  }

  /** Ends the stream: returns the remaining full chunks and a final `last` chunk. */
  flush() {
    if (this.finished) return [];
    this.finished = true;
    this.resampler.end();
    const chunks = this.drain();
    chunks.push({ pcm: this.pcm.slice(0, this.fill), sampleRate: this.rate, last: true });
    return chunks;
  }

  drain() {
    const chunks = [];
    for (;;) {
      const want = this.size - this.fill;
      const got = this.resampler.read(this.scratch, want);
      toInt16(this.scratch, this.pcm, this.fill, got);
      this.fill += got;
      if (this.fill < this.size) return chunks;
      chunks.push({ pcm: this.pcm, sampleRate: this.rate, last: false });
      const next = this.pendingRate ?? this.rate;
      this.pendingRate = null;
      this.startChunk(next);
    }
  }
}

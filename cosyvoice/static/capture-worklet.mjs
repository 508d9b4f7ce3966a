// Audio worklet of the browser page: runs on the audio thread, turns the microphone's
// blocks into 200 ms chunks of 16-bit PCM at the session's rate and posts each chunk to
// the page. The arithmetic lives in pcm-chunker.mjs, which the tests load too.

import { PcmChunker } from "./pcm-chunker.mjs";

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate, chunkMs } = options.processorOptions;
    // `sampleRate` is the AudioContext's rate, a global of the worklet scope.
    this.chunker = new PcmChunker(sampleRate, targetRate, chunkMs);
    this.done = false;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  onMessage(msg) {
    if (msg.type === "rate") {
      this.chunker.setRate(msg.rate);
    } else if (msg.type === "flush") {
      this.post(this.chunker.flush());
      this.done = true;
    }
  }

  post(chunks) {
    for (const { pcm, sampleRate: rate, last } of chunks) {
      this.port.postMessage({ type: "chunk", pcm: pcm.buffer, sampleRate: rate, last },
                            [pcm.buffer]);
    }
  }

  process(inputs) {
    if (this.done) return false;
    const channels = inputs[0];
    // No channels while the source is not (yet) delivering audio.
    if (channels && channels.length) this.post(this.chunker.push(channels));
    return true;
  }
}

registerProcessor("cosyvoice-capture", CaptureProcessor);

// The microphone: getUserMedia into an AudioWorklet that posts 200 ms PCM chunks.

import { CHUNK_MS } from "./pcm-chunker.mjs";

const FLUSH_TIMEOUT_MS = 2000;

/** A failure to open the microphone, with `reason` one of denied | missing | insecure | busy | unloaded | failed. */
export class MicrophoneError extends Error {
  constructor(reason, cause) {
    super(`microphone ${reason}`, { cause });
    this.reason = reason;
  }
}

function reasonOf(err) {
  switch (err?.name) {
    case "NotAllowedError":
    case "SecurityError":
      return "denied";
    case "NotFoundError":
    case "OverconstrainedError":
      return "missing";
    case "NotReadableError":
    case "AbortError":
      return "busy";
    default:
      return "failed";
  }
}

export class Microphone {
  /** `onChunk({pcm: Int16Array, sampleRate, last})` gets every chunk, in order. */
  constructor(onChunk) {
    this.onChunk = onChunk;
    this.media = null;
    this.context = null;
    this.node = null;
    this.finished = null;
    this.onEnded = null;
  }

  get deviceRate() {
    return this.context?.sampleRate ?? 0;
  }

  async start(rate) {
    if (!globalThis.isSecureContext || !navigator.mediaDevices?.getUserMedia) {
      throw new MicrophoneError("insecure");
    }
    try {
      // Raw audio: echo cancellation, noise suppression and gain control all cost accuracy.
      this.media = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: false, noiseSuppression: false, autoGainControl: false },
      });
    } catch (err) {
      throw new MicrophoneError(reasonOf(err), err);
    }
    try {
      this.context = new AudioContext({ latencyHint: "interactive" });
      await this.loadWorklet();
      this.node = new AudioWorkletNode(this.context, "cosyvoice-capture", {
        numberOfInputs: 1,
        numberOfOutputs: 0,
        processorOptions: { targetRate: rate, chunkMs: CHUNK_MS },
      });
      let finish;
      this.finished = new Promise((resolve) => { finish = resolve; });
      this.node.port.onmessage = ({ data }) => {
        if (data.type !== "chunk") return;
        this.onChunk({ pcm: new Int16Array(data.pcm), sampleRate: data.sampleRate, last: data.last });
        if (data.last) finish();
      };
      this.context.createMediaStreamSource(this.media).connect(this.node);
      for (const track of this.media.getAudioTracks()) {
        track.addEventListener("ended", () => this.onEnded?.());
      }
      if (this.context.state === "suspended") await this.context.resume();
    } catch (err) {
      this.release();
      throw err instanceof MicrophoneError ? err : new MicrophoneError("failed", err);
    }
  }

  async loadWorklet() {
    try {
      await this.context.audioWorklet.addModule(new URL("./capture-worklet.mjs", import.meta.url));
    } catch (err) {
      // Fetched from the server at the first Start: fails when the server went away.
      throw new MicrophoneError("unloaded", err);
    }
  }

  /** Capture at a new rate; the chunk after the current one carries it. */
  setRate(rate) {
    this.node?.port.postMessage({ type: "rate", rate });
  }

  /** Stops capturing: the worklet sends what it holds as the `last` chunk, then all closes. */
  async finish() {
    if (this.node) {
      this.node.port.postMessage({ type: "flush" });
      // A context the browser suspended cannot answer; do not hang the page on it.
      await Promise.race([this.finished, new Promise((resolve) => setTimeout(resolve, FLUSH_TIMEOUT_MS))]);
    }
    this.release();
  }

  /** Closes everything at once, dropping audio not yet chunked. */
  release() {
    for (const track of this.media?.getTracks() ?? []) track.stop();
    this.node?.disconnect();
    if (this.context && this.context.state !== "closed") this.context.close();
    this.media = this.context = this.node = null;
  }
}

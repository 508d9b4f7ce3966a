// Opus for the wire: the browser's WebCodecs AudioEncoder at 16 kHz mono with 20 ms
// frames, its packets grouped ten to a 200 ms chunk (proto/chunk.proto, codec OPUS).

export const OPUS_RATE = 16000;
export const FRAME_MS = 20;
export const PACKETS_PER_CHUNK = 10;

/** The AudioEncoder configuration of the wire's Opus at `bitrate` bit/s. */
export function opusConfig(bitrate) {
  return {
    codec: "opus",
    sampleRate: OPUS_RATE,
    numberOfChannels: 1,
    bitrate,
    opus: { format: "opus", frameDuration: FRAME_MS * 1000, signal: "voice" },
  };
}

/** True where this browser encodes the wire's Opus at `bitrate` (WebCodecs). */
export async function opusSupported(bitrate) {
  if (typeof globalThis.AudioEncoder !== "function") return false;
  try {
    return (await globalThis.AudioEncoder.isConfigSupported(opusConfig(bitrate))).supported === true;
  } catch {
    return false;
  }
}

/**
 * 16 kHz Int16 chunks in, chunks of Opus packets out: `onChunk({opus, bitrate, last})`
 * with `opus` an array of ten packets (Uint8Array), in order. `finish()` flushes the
 * encoder and sends what is left as the `last` chunk.
 */
export class OpusChunker {
  constructor(bitrate, onChunk) {
    this.bitrate = bitrate;
    this.onChunk = onChunk;
    this.packets = [];
    this.samples = 0; // samples handed to the encoder, for the frames' timestamps
    this.failed = null;
    this.encoder = new globalThis.AudioEncoder({
      output: (packet) => this.output(packet),
      error: (err) => { this.failed = err; },
    });
    this.encoder.configure(opusConfig(bitrate));
  }

  /** Encodes one chunk of 16 kHz samples (an Int16Array). */
  encode(pcm) {
    if (!pcm.length) return;
    const data = new globalThis.AudioData({
      format: "s16",
      sampleRate: OPUS_RATE,
      numberOfFrames: pcm.length,
      numberOfChannels: 1,
      timestamp: Math.round((this.samples * 1e6) / OPUS_RATE),
      data: pcm,
    });
    this.samples += pcm.length;
    this.encoder.encode(data);
    data.close();
  }

  output(packet) {
    const bytes = new Uint8Array(packet.byteLength);
    packet.copyTo(bytes);
    this.packets.push(bytes);
    while (this.packets.length >= PACKETS_PER_CHUNK) {
      this.onChunk({ opus: this.packets.splice(0, PACKETS_PER_CHUNK), bitrate: this.bitrate, last: false });
    }
  }

  /** Encodes at `bitrate` from the next chunk on. */
  setBitrate(bitrate) {
    if (bitrate === this.bitrate || this.encoder.state === "closed") return;
    this.bitrate = bitrate;
    this.encoder.configure(opusConfig(bitrate));
  }

  /** The encoder's last packets, sent as a chunk that is not the last, then closed: PCM
   * takes over from here. */
  async drain() {
    try {
      await this.encoder.flush();
    } catch {
      // a failed encoder: what it encoded goes out
    }
    if (this.packets.length) this.onChunk({ opus: this.packets.splice(0), bitrate: this.bitrate, last: false });
    if (this.encoder.state !== "closed") this.encoder.close();
  }

  /** The end of the recording: every packet the encoder holds, sent as the last chunk. */
  async finish() {
    try {
      await this.encoder.flush();
    } catch {
      // a failed encoder: the last chunk carries what was encoded
    }
    this.onChunk({ opus: this.packets.splice(0), bitrate: this.bitrate, last: true });
    if (this.encoder.state !== "closed") this.encoder.close();
  }
}

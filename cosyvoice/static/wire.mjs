// The audio_chunk payload: AudioChunkProto (proto/chunk.proto) encoded by the static code
// protobufjs generated into chunk_pb.js, which the page loads before its modules.

function messageType() {
  const type = globalThis.protobuf?.roots?.default?.cosyvoice?.AudioChunkProto;
  if (!type) throw new Error("chunk_pb.js (protobufjs) is not loaded");
  return type;
}

// The Codec enum of proto/chunk.proto
const OPUS = 1;

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** Int16 samples as little-endian bytes, whatever the platform's byte order. */
export function pcmBytes(pcm) {
  if (LITTLE_ENDIAN) return new Uint8Array(pcm.buffer, pcm.byteOffset, pcm.byteLength);
  const bytes = new Uint8Array(pcm.length * 2);
  const view = new DataView(bytes.buffer);
  pcm.forEach((v, i) => view.setInt16(2 * i, v, true));
  return bytes;
}

/**
 * Serialises one chunk. `pcm` is an Int16Array of mono samples; `sampleRate` 0 means
 * "the session's current rate". Returns bytes that own their buffer, ready to send.
 */
export function encodeChunk({ pcm, seq, last = false, sampleRate = 0, sentMs = 0 }) {
  const message = { pcm: pcmBytes(pcm), seq, last, sample_rate: sampleRate, sent_ms: sentMs };
  const bytes = messageType().encode(message).finish();
  // The writer may hand out a view into a shared slab: copy out this message's bytes.
  return bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength ? bytes : new Uint8Array(bytes);
}

/** Serialises one chunk of Opus packets (Uint8Arrays, 20 ms of 16 kHz audio each). */
export function encodeOpusChunk({ opus, seq, last = false, bitrate = 0, sentMs = 0 }) {
  const message = { codec: OPUS, opus, bitrate, seq, last, sent_ms: sentMs };
  const bytes = messageType().encode(message).finish();
  return bytes.byteOffset === 0 && bytes.byteLength === bytes.buffer.byteLength ? bytes : new Uint8Array(bytes);
}

/** Parses a payload back; the tests use it to check the encoding. */
export function decodeChunk(bytes) {
  return messageType().decode(bytes);
}

// One recording's conversation with the gateway over Socket.IO (namespace /ws): chunk
// numbering, acks, reconnection with resume, results, end and stop.

import { encodeChunk, encodeOpusChunk } from "./wire.mjs";

const NAMESPACE = "/ws";
// Reconnection as a deployment tunes it: 5 attempts, starting 1 s apart (backing off to
// socket.io's 5 s cap), all well inside the server's 30 s resume grace period.
export const RECONNECT_ATTEMPTS = 5;
export const RECONNECT_DELAY_MS = 1000;
// Error codes that end the recording. Refusals at connect arrive as `connect_error`
// (their data is the wire error); `session_expired` on reconnect is only a notice that a
// fresh session follows.
const FATAL_CODES = new Set(["overloaded", "unauthorized"]);
// Chunks sent and not acknowledged while following the server's switches (`abr`), beyond
// those the path's shortest round trip holds: about a second, so the network's queue
// stays short and what waits goes at the rung in use when it is sent.
export const ABR_IN_FLIGHT = 5;

/**
 * A recording's stream of chunks and results.
 *
 * `handlers` receives: state(name, detail) with name connecting | connected |
 * reconnecting | disconnected | refused | failed | closed; session(info, kind) with kind new |
 * resumed | restarted; text(result, latencyMs); relabel({utterance, speaker}); rungSwitch({codec, bitrate, sample_rate,
 * reason}, direction) with direction down | up;
 * error({code, msg}, fatal); end().
 */
export class SpeechStream {
  /** `token` is sent as `auth.token` when the service requires one; `mode` (one of the
   * server's session modes) asks for a mode when the session is created; `bitrate` says
   * the audio goes as Opus at that bitrate (`auth.codec`, `auth.bitrate`); `abr` that the
   * page follows the server's switch_down and switch_up (`auth.abr`); `language` ("auto" or
   * a code), `script` ("hans" or "hant"), `format` (digits) and `diarize` (speaker labels)
   * are the session's `auth.language`, `auth.script`, `auth.format` and `auth.diarize`. */
  constructor(handlers, { token = null, mode = null, bitrate = 0, abr = false, language = null,
    script = null, format = false, diarize = false } = {}) {
    this.on = handlers;
    this.token = token;
    this.mode = mode;
    this.options = { language, script, format, diarize };
    this.bitrate = bitrate;
    this.abr = abr;
    this.socket = null;
    this.session = null; // {id, rate, chunkMs, limits} of the current session
    this.lastResultId = null; // id of the last result received, for resume
    // chunks not acked yet, in order: {pcm, sampleRate, last, seq, sent}, or {opus,
    // bitrate, last, seq, sent} (Opus packets, resent as they were encoded)
    this.pending = [];
    this.nextSeq = 0;
    this.announcedRate = null; // rate last sent explicitly on this connection
    this.ready = false; // a `session` event arrived on the current connection
    this.minRttMs = null; // the shortest chunk-to-ack time seen
    // Until the first ack, the handshake's time stands in for the round trip (it takes about
    // two), so a long path neither stalls the first chunks nor sends them in one burst.
    this.openedAt = null;
    this.handshakeMs = null;
    this.sentAt = new Map(); // seq -> performance.now() when sent, for latency
    this.seenFinals = new Set();
    this.ended = false;
    this.endWaiters = [];
    this.closing = false;
  }

  open() {
    this.on.state("connecting");
    this.openedAt = performance.now();
    const socket = globalThis.io(NAMESPACE, {
      transports: ["websocket"],
      forceNew: true,
      reconnection: true,
      reconnectionAttempts: RECONNECT_ATTEMPTS,
      reconnectionDelay: RECONNECT_DELAY_MS,
      auth: (cb) => cb(this.auth()),
    });
    this.socket = socket;
    socket.on("connect", () => this.on.state("connected"));
    socket.on("session", (data) => this.onSession(data));
    socket.on("text", (data) => this.onText(data));
    socket.on("end", () => this.onEnd());
    socket.on("relabel", (data) => {
      if (data.id) this.lastResultId = data.id;
      this.on.relabel?.(data);
    });
    socket.on("load", (data) => this.on.load?.(data));
    socket.on("error", (data) => this.on.error(data, FATAL_CODES.has(data.code)));
    socket.on("switch_down", (data) => this.on.rungSwitch(data, "down"));
    socket.on("switch_up", (data) => this.on.rungSwitch(data, "up"));
    socket.on("disconnect", (reason) => this.onDisconnect(reason));
    socket.on("connect_error", (err) => {
      // Not `active`: the server refused the connection and socket.io will not retry.
      if (socket.active) return;
      if (err.data?.code) this.on.error(err.data, true);
      this.on.state("refused");
    });
    socket.io.on("reconnect_attempt", (attempt) => this.on.state("reconnecting", attempt));
    socket.io.on("reconnect_failed", () => {
      this.on.state("failed");
      this.on.error({ code: "unreachable", msg: "no answer from the server" }, true);
    });
  }

  auth() {
    const auth = {};
    if (this.token) auth.token = this.token;
    const net = globalThis.navigator?.connection;
    if (net) auth.network_hint = { effective_type: net.effectiveType, downlink_mbps: net.downlink, rtt_ms: net.rtt };
    if (this.session) {
      auth.session = this.session.id;
      if (this.lastResultId) auth.last_result = this.lastResultId;
    } else {
      if (this.mode) auth.mode = this.mode;
      for (const [key, value] of Object.entries(this.options)) {
        if (value) auth[key] = value;
      }
    }
    if (this.bitrate) {
      auth.codec = "opus";
      auth.bitrate = this.bitrate;
    }
    if (this.abr) auth.abr = true;
    return auth;
  }

  onSession(data) {
    const previous = this.session;
    let kind = "new";
    if (previous && data.resumed && data.session === previous.id) {
      kind = "resumed";
      // The server holds everything below next_seq; the rest is sent again.
      this.pending = this.pending.filter((c) => c.seq === null || c.seq >= data.next_seq);
    } else {
      if (previous) {
        kind = "restarted";
        // A new session numbers from its own next_seq; unacked audio goes into it.
        for (const c of this.pending) c.seq = null;
        this.sentAt.clear();
        this.seenFinals.clear();
        this.lastResultId = null;
      }
      this.nextSeq = data.next_seq;
    }
    this.session = {
      id: data.session, rate: data.sample_rate, chunkMs: data.chunk_ms, limits: data.limits,
      codec: data.codec, bitrate: data.bitrate, abr: Boolean(data.abr),
    };
    if (this.openedAt !== null) {
      this.handshakeMs = performance.now() - this.openedAt;
      this.openedAt = null;
    }
    this.ready = true;
    this.announcedRate = null;
    this.on.session(this.session, kind);
    this.pump();
  }

  onDisconnect(reason) {
    this.ready = false;
    for (const c of this.pending) c.sent = false;
    // Whatever socket.io buffered belongs to the lost connection; pump() resends.
    this.socket.sendBuffer.length = 0;
    if (this.closing) this.on.state("closed");
    else if (reason === "io server disconnect") this.on.state("disconnected");
    else this.on.state("reconnecting", 0);
  }

  /** Queues one chunk ({pcm: Int16Array, sampleRate, last}, or {opus: [Uint8Array],
   * bitrate, last}) and sends what it can. */
  send(chunk) {
    this.pending.push({ ...chunk, seq: null, sent: false });
    this.pump();
  }

  pump() {
    if (!this.ready || !this.socket.connected) return;
    let inFlight = this.pending.filter((c) => c.sent).length;
    const limit = ABR_IN_FLIGHT + Math.floor((this.minRttMs ?? this.handshakeMs ?? 0) / 200);
    for (const c of this.pending) {
      if (c.sent) continue;
      if (this.abr && this.session.abr && inFlight >= limit) break;
      inFlight += 1;
      if (c.seq === null) c.seq = this.nextSeq++;
      let payload;
      if (c.opus) {
        payload = encodeOpusChunk({ opus: c.opus, seq: c.seq, last: c.last, bitrate: c.bitrate, sentMs: Date.now() });
        this.announcedRate = null; // PCM after Opus names its rate again
      } else {
        // The first chunk on a connection and the first after a switch name their rate.
        const sampleRate = c.sampleRate === this.announcedRate ? 0 : c.sampleRate;
        this.announcedRate = c.sampleRate;
        payload = encodeChunk({ pcm: c.pcm, seq: c.seq, last: c.last, sampleRate, sentMs: Date.now() });
      }
      c.sentAt = performance.now();
      this.sentAt.set(c.seq, c.sentAt);
      c.sent = true;
      this.socket.emit("audio_chunk", payload, () => this.acked(c));
    }
  }

  acked(chunk) {
    // Refused chunks are acked too ({error, seq}); the `error` event explains them.
    const i = this.pending.indexOf(chunk);
    if (i >= 0) this.pending.splice(i, 1);
    const rtt = performance.now() - chunk.sentAt;
    if (rtt >= 0) this.minRttMs = Math.min(this.minRttMs ?? rtt, rtt);
    if (this.abr) this.pump(); // room in flight for the next one
  }

  onText(result) {
    if (result.id) this.lastResultId = result.id;
    let latencyMs = null;
    if (result.type === "final") {
      const key = result.id ?? `u${result.utterance}`;
      if (this.seenFinals.has(key)) return; // replayed after a resume
      this.seenFinals.add(key);
      if (this.sentAt.has(result.seq)) latencyMs = performance.now() - this.sentAt.get(result.seq);
      for (const seq of this.sentAt.keys()) if (seq < result.seq) this.sentAt.delete(seq);
    }
    this.on.text(result, latencyMs);
  }

  onEnd() {
    this.ended = true;
    for (const resolve of this.endWaiters.splice(0)) resolve(true);
    this.on.end();
  }

  /** Resolves true once the server sent `end` (every result delivered), false on timeout. */
  waitEnd(timeoutMs) {
    if (this.ended) return Promise.resolve(true);
    return new Promise((resolve) => {
      const timer = setTimeout(() => resolve(false), timeoutMs);
      this.endWaiters.push((ended) => {
        clearTimeout(timer);
        resolve(ended);
      });
    });
  }

  /** Sends `stop` (the server deletes the session's data) and closes the connection. */
  async close() {
    this.closing = true;
    if (this.socket?.connected && this.ready) {
      try {
        await this.socket.timeout(5000).emitWithAck("stop");
      } catch {
        // No answer: the server expires the session after its grace period anyway.
      }
    }
    this.socket?.disconnect();
  }
}

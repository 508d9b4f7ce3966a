// The page's session protocol (stream.mjs) against a scripted Socket.IO connection.
// The gateway does not offer resume yet, so resume is exercised here with a stand-in for
// socket.io-client that plays the server's side; everything else uses the real code.

import assert from "node:assert/strict";
import { test } from "node:test";

import "./page-globals.mjs";
import { RECONNECT_ATTEMPTS, RECONNECT_DELAY_MS, SpeechStream } from "../../cosyvoice/static/stream.mjs";
import { decodeChunk } from "../../cosyvoice/static/wire.mjs";

class ScriptedSocket {
  constructor(url, options) {
    this.url = url;
    this.options = options;
    this.handlers = {};
    this.managerHandlers = {};
    this.io = { on: (event, fn) => { this.managerHandlers[event] = fn; } };
    this.connected = false;
    this.sendBuffer = [];
    this.emitted = [];
    this.auths = [];
  }

  on(event, fn) {
    this.handlers[event] = fn;
  }

  emit(event, payload, ack) {
    this.emitted.push({ event, chunk: decodeChunk(payload), ack });
  }

  // The server's side: a connection that answers with a `session` event.
  accept(session) {
    this.options.auth((auth) => this.auths.push(auth));
    this.connected = true;
    this.handlers.connect();
    this.handlers.session({ chunk_ms: 200, limits: {}, ...session });
  }

  drop() {
    this.connected = false;
    this.handlers.disconnect("transport close");
  }

  ackAll() {
    for (const e of this.emitted.splice(0)) e.ack({ seq: e.chunk.seq });
  }

  sentChunks() {
    return this.emitted.map(({ chunk }) => ({ seq: chunk.seq, rate: chunk.sample_rate, last: chunk.last, n: chunk.pcm.length / 2 }));
  }
}

function recorder() {
  const log = { states: [], sessions: [], texts: [], errors: [] };
  const handlers = {
    state: (s, d) => log.states.push(d === undefined ? s : `${s}:${d}`),
    session: (info, kind) => log.sessions.push([info.id, kind]),
    text: (result, latency) => log.texts.push({ ...result, latency }),
    rungSwitch: () => {},
    error: (err, fatal) => log.errors.push([err.code, fatal]),
    end: () => {},
  };
  return { log, handlers };
}

function open() {
  let socket;
  globalThis.io = (url, options) => (socket = new ScriptedSocket(url, options));
  const { log, handlers } = recorder();
  const stream = new SpeechStream(handlers);
  stream.open();
  return { stream, socket, log };
}

const chunk = (n, sampleRate = 16000, last = false) => ({ pcm: new Int16Array(n).fill(1), sampleRate, last });

test("connects over WebSocket only, with 5 reconnection attempts 1 s apart", () => {
  const { socket } = open();
  assert.equal(socket.url, "/ws");
  assert.deepEqual(socket.options.transports, ["websocket"]);
  assert.equal(socket.options.reconnectionAttempts, 5);
  assert.equal(RECONNECT_ATTEMPTS, 5);
  assert.equal(socket.options.reconnectionDelay, 1000);
  assert.equal(RECONNECT_DELAY_MS, 1000);
});

test("chunks wait for the session, then go out numbered from next_seq; the first names its rate", () => {
  const { stream, socket } = open();
  stream.send(chunk(3200));
  stream.send(chunk(3200));
  assert.equal(socket.emitted.length, 0);
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  stream.send(chunk(1600, 8000)); // after a switch_down
  stream.send(chunk(1600, 8000));
  stream.send(chunk(100, 8000, true));
  assert.deepEqual(socket.sentChunks(), [
    { seq: 0, rate: 16000, last: false, n: 3200 },
    { seq: 1, rate: 0, last: false, n: 3200 },
    { seq: 2, rate: 8000, last: false, n: 1600 },
    { seq: 3, rate: 0, last: false, n: 1600 },
    { seq: 4, rate: 0, last: true, n: 100 },
  ]);
  assert.ok(socket.emitted.every(({ chunk: c }) => Number(c.sent_ms) > 1.6e12));
});

test("a resumed session gets the unacked chunks again, same seqs, and no final twice", () => {
  const { stream, socket, log } = open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  for (let i = 0; i < 4; i++) stream.send(chunk(3200));
  socket.emitted[0].ack({ seq: 0 });
  socket.handlers.text({ type: "final", text: "hello", utterance: 0, seq: 0, id: "5-0" });
  socket.emitted.length = 0;
  socket.drop();
  stream.send(chunk(3200)); // captured while the connection is down
  assert.equal(socket.emitted.length, 0);

  // The server stored seq 1 before the drop (its ack was lost) and asks from seq 2 on.
  socket.accept({ session: "s1", resumed: true, next_seq: 2, sample_rate: 16000 });
  assert.deepEqual(socket.auths.at(-1), { session: "s1", last_result: "5-0" });
  assert.deepEqual(log.sessions, [["s1", "new"], ["s1", "resumed"]]);
  assert.deepEqual(socket.sentChunks().map((c) => [c.seq, c.rate]), [[2, 16000], [3, 0], [4, 0]]);
  // A result replayed from the session's stream is not shown twice.
  socket.handlers.text({ type: "final", text: "hello", utterance: 0, seq: 0, id: "5-0" });
  assert.deepEqual(log.texts.map((t) => t.text), ["hello"]);
});

test("when the server cannot resume, unacked audio starts a fresh session from seq 0", () => {
  const { stream, socket, log } = open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  for (let i = 0; i < 3; i++) stream.send(chunk(3200));
  socket.emitted[0].ack({ seq: 0 });
  socket.emitted.length = 0;
  socket.drop();
  socket.accept({ session: "s2", resumed: false, next_seq: 0, sample_rate: 16000 });
  assert.equal(socket.auths.at(-1).session, "s1");
  assert.deepEqual(log.sessions, [["s1", "new"], ["s2", "restarted"]]);
  assert.deepEqual(socket.sentChunks().map((c) => [c.seq, c.rate]), [[0, 16000], [1, 0]]);
  stream.send(chunk(3200));
  assert.equal(socket.sentChunks().at(-1).seq, 2);
});

test("a final's latency is measured from when its chunk was sent", async () => {
  const { stream, socket, log } = open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  stream.send(chunk(3200, 16000, true));
  await new Promise((resolve) => setTimeout(resolve, 30));
  socket.handlers.text({ type: "partial", text: "hel", utterance: 0, seq: 0, id: "1-0" });
  socket.handlers.text({ type: "final", text: "hello", utterance: 0, seq: 0, id: "2-0" });
  assert.equal(log.texts[0].latency, null);
  assert.ok(log.texts[1].latency >= 25 && log.texts[1].latency < 1000, String(log.texts[1].latency));
});

test("waitEnd resolves on `end`, or false after its timeout", async () => {
  const { stream, socket } = open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  assert.equal(await stream.waitEnd(20), false);
  const waiting = stream.waitEnd(5000);
  socket.handlers.end({ session: "s1" });
  assert.equal(await waiting, true);
});

test("fatal server errors are flagged; the rest are not", () => {
  const { socket, log } = open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000 });
  socket.handlers.error({ code: "overloaded", msg: "busy" });
  socket.handlers.error({ code: "unsupported_rate", msg: "no", seq: 0 });
  assert.deepEqual(log.errors, [["overloaded", true], ["unsupported_rate", false]]);
});

test("session_expired on reconnect is a notice: a fresh session follows", () => {
  const { socket, log } = open();
  socket.handlers.error({ code: "session_expired", msg: "the session expired; a new one was started" });
  socket.accept({ session: "s2", resumed: false, next_seq: 0, sample_rate: 16000 });
  assert.deepEqual(log.errors, [["session_expired", false]]);
});

test("a refusal by connect_error reports the server's error and stops", () => {
  const { socket, log } = open();
  socket.active = false;
  socket.handlers.connect_error(Object.assign(new Error("refused"), { data: { code: "unauthorized", msg: "no" } }));
  assert.deepEqual(log.errors, [["unauthorized", true]]);
  assert.equal(log.states.at(-1), "refused");
});

test("following switches: auth says so, at most five chunks fly, and switches reach the page", () => {
  let socket;
  globalThis.io = (url, options) => (socket = new ScriptedSocket(url, options));
  const switches = [];
  const { handlers } = recorder();
  handlers.rungSwitch = (rung, direction) => switches.push([rung.codec, rung.bitrate, rung.reason, direction]);
  const stream = new SpeechStream(handlers, { abr: true, bitrate: 32000 });
  stream.open();
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000, codec: "opus", bitrate: 24000, abr: true });
  assert.equal(socket.auths[0].abr, true);
  assert.equal(socket.auths[0].codec, "opus");
  assert.equal(stream.session.bitrate, 24000); // the rung the server started it on
  for (let i = 0; i < 8; i++) stream.send({ opus: [new Uint8Array([8, i])], bitrate: 24000, last: false });
  assert.deepEqual(socket.emitted.map((e) => e.chunk.seq), [0, 1, 2, 3, 4]);
  socket.emitted[0].ack({ seq: 0 });
  socket.emitted[1].ack({ seq: 1 });
  assert.deepEqual(socket.emitted.map((e) => e.chunk.seq), [0, 1, 2, 3, 4, 5, 6]);
  assert.equal(socket.emitted[5].chunk.codec, 1); // OPUS
  socket.handlers.switch_down({ codec: "opus", bitrate: 12000, sample_rate: 16000, reason: "congestion" });
  socket.handlers.switch_up({ codec: "pcm16", bitrate: 256000, sample_rate: 16000, reason: "probe" });
  assert.deepEqual(switches, [["opus", 12000, "congestion", "down"], ["pcm16", 256000, "probe", "up"]]);
});

test("until the first ack, the handshake's time stands in for the round trip", () => {
  let socket;
  globalThis.io = (url, options) => (socket = new ScriptedSocket(url, options));
  const stream = new SpeechStream(recorder().handlers, { abr: true, bitrate: 32000 });
  stream.open();
  stream.openedAt = performance.now() - 2100; // a handshake of about two 1 s round trips
  socket.accept({ session: "s1", resumed: false, next_seq: 0, sample_rate: 16000, codec: "opus", bitrate: 32000, abr: true });
  assert.ok(stream.handshakeMs >= 2100);
  for (let i = 0; i < 20; i++) stream.send({ opus: [new Uint8Array([8, i])], bitrate: 32000, last: false });
  assert.equal(socket.emitted.length, 15); // five, and the ten a 2 s path holds
  socket.emitted[0].ack({ seq: 0 }); // the first ack measures the round trip: about none here
  assert.ok(stream.minRttMs < 1000);
  assert.equal(socket.emitted.length, 15); // fourteen in flight, five allowed now
});

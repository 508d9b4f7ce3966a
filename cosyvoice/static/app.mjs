// The browser page: Start/Stop, live transcript, connection state, latency, errors.

import { Microphone } from "./microphone.mjs";
import { OPUS_RATE, OpusChunker, opusSupported } from "./opus-encoder.mjs";
import { RECONNECT_ATTEMPTS, SpeechStream } from "./stream.mjs";
import { toSrt, toText, toVtt } from "./subtitles.mjs";
import { TranscriptView } from "./transcript.mjs";

// Capture rate until the server's `session` event names the session's rate.
const INITIAL_RATE = 16000;
// How long Stop waits for the server's `end` (all final text delivered).
const END_TIMEOUT_MS = 20000;
// A file is sent at this share of the server's rate limit (`limits.rate_limit_factor` ×
// real time), or at FILE_UNLIMITED_SPEED × real time where the server sets none.
const FILE_RATE_SHARE = 0.9;
const FILE_UNLIMITED_SPEED = 8;
const FILE_RATE = 16000;
const CHUNK_MS = 200;
// What each session mode means, for the mode choice.
const MODE_NAMES = {
  "whisper-live": "Live (Whisper)",
  "2pass": "Live partials, Whisper base finals",
  whisper: "Whisper base finals only",
  pocketsphinx: "PocketSphinx",
  null: "Null (test engine)",
};
// The session choices the page remembers (localStorage), by the auth key they set.
const REMEMBERED = { language: "cosyvoice.language", script: "cosyvoice.script", format: "cosyvoice.format", diarize: "cosyvoice.diarize" };
const DOWNLOADS = {
  txt: { render: toText, type: "text/plain" },
  srt: { render: toSrt, type: "application/x-subrip" },
  vtt: { render: toVtt, type: "text/vtt" },
};

const MESSAGES = {
  denied: "Microphone access was denied. Allow this site to use the microphone (see the icon in the address bar), then press Start again.",
  missing: "No microphone was found. Connect one and press Start again.",
  busy: "The microphone could not be opened; another application may be using it.",
  insecure: "The microphone is only available on a secure page: open this service over https (or on localhost).",
  unloaded: "The audio capture code could not be loaded from the server. Check your connection and reload the page.",
  failed: "Audio capture could not start in this browser.",
  ended: "The microphone stopped delivering audio.",
  unreachable: "Cannot reach the server. Check your network connection and try again.",
  closed: "The server closed the connection.",
  timeout: "The server did not deliver the final text in time; the transcript may be incomplete.",
  overloaded: "The service is at capacity and cannot take another recording right now.",
  unsupported_rate: "The server does not accept audio at this sample rate.",
  rate_limited: "The server's limits for this address were reached.",
  refused: "The server refused the connection.",
  unauthorized: "The server refused the connection: this service needs a valid token. "
    + "Ask its operator for a link that carries one (…/#token=…).",
  session_expired: "The session has expired. Press Start to begin a new one.",
  session_lost: "The service's storage restarted and lost the audio since the last final "
    + "text; the recording goes on in a new session.",
  not_audio: "could not be read as audio. Choose a sound file (WAV, MP3, FLAC, Ogg, M4A, WebM…).",
  clipboard: "The transcript could not be copied: this browser did not allow access to the clipboard.",
  unavailable: "The service's storage is unreachable; some audio may be lost.",
  bad_chunk: "The server refused a piece of audio as malformed.",
  too_large: "The server refused a piece of audio as too large.",
  seq_gap: "Some audio went missing on the way to the server.",
  internal: "The server hit an internal error.",
};

// A token for services that require one, from the page address: /#token=… (the part
// after # never reaches a server or its logs).
function pageToken() {
  return new URLSearchParams(globalThis.location.hash.slice(1)).get("token");
}

// The codec the page was asked for (`?codec=pcm16` or `?codec=opus`), if any.
function pageCodec() {
  return new URLSearchParams(globalThis.location.search).get("codec");
}

/** How the codec in use reads beside the rates: "Opus 32 kbit/s", or "PCM". */
function codecName(bitrate) {
  return bitrate ? `Opus ${bitrate / 1000} kbit/s` : "PCM";
}

// Codes whose message above says it all; other codes also show the server's words.
const OWN_WORDS = new Set(["overloaded", "unauthorized", "session_expired", "session_lost"]);

function kHz(rate) {
  return `${(rate / 1000).toLocaleString("en", { maximumFractionDigits: 1 })} kHz`;
}

class App {
  constructor(doc) {
    const $ = (id) => doc.getElementById(id);
    this.button = $("record");
    this.label = this.button.querySelector(".label");
    this.connection = $("connection");
    this.busy = $("busy");
    this.message = $("message");
    this.latency = $("latency");
    this.audio = $("audio");
    this.sessionInfo = $("session");
    this.level = $("level");
    this.view = new TranscriptView($("finals"), $("partial"), $("placeholder"));
    this.state = "idle";
    this.mic = null;
    this.stream = null;
    this.errorShown = false;
    this.rate = INITIAL_RATE;
    this.codecOffer = null; // the server's `limits.codecs`, from /config
    this.encoder = null; // an OpusChunker while the microphone's audio goes as Opus
    this.modeChoice = $("mode-choice");
    this.modeSelect = $("mode");
    this.languageChoice = $("language-choice");
    this.languageSelect = $("language");
    this.scriptChoice = $("script-choice");
    this.scriptSelect = $("script");
    this.formatChoice = $("format-choice");
    this.formatBox = $("format");
    this.languageSelect.addEventListener("change", () => this.rememberChoices());
    this.scriptSelect.addEventListener("change", () => this.rememberChoices());
    this.formatBox.addEventListener("change", () => this.rememberChoices());
    // speaker labels: any engine, remembered like the language
    this.speakersBox = $("speakers");
    this.speakersBox.checked = globalThis.localStorage?.getItem(REMEMBERED.diarize) === "1";
    this.speakersBox.addEventListener("change", () => this.rememberChoices());
    this.transcript = $("transcript");
    this.button.addEventListener("click", () => this.toggle());
    $("clear").addEventListener("click", () => this.view.clear());
    $("copy").addEventListener("click", () => this.copy());
    for (const format of Object.keys(DOWNLOADS)) {
      $(`download-${format}`).addEventListener("click", () => this.download(format));
    }
    const picker = $("file");
    picker.addEventListener("change", () => {
      const [file] = picker.files;
      picker.value = "";
      if (file) this.transcribeFile(file);
    });
    this.transcript.addEventListener("dragover", (e) => {
      e.preventDefault();
      this.transcript.classList.add("dragging");
    });
    this.transcript.addEventListener("dragleave", () => this.transcript.classList.remove("dragging"));
    this.transcript.addEventListener("drop", (e) => {
      e.preventDefault();
      this.transcript.classList.remove("dragging");
      const file = e.dataTransfer?.files?.[0];
      if (file) this.transcribeFile(file);
    });
    // Start waits for it: on a slow link /config may come after the first click, and
    // without the codec offer the page would send PCM where Opus was what it needed.
    this.configLoaded = this.loadConfig();
    $("details").addEventListener("change", (e) => $("transcript").classList.toggle("details", e.target.checked));
    this.setState("idle");
  }

  toggle() {
    if (this.state === "idle") this.start();
    else if (this.state === "recording") this.stop();
  }

  /** The server's session modes: a choice before Start where it offers more than one. */
  async loadConfig() {
    let config;
    try {
      const response = await fetch("/config");
      if (!response.ok) return;
      config = await response.json();
    } catch {
      return; // the recording itself says what is wrong with the server
    }
    this.codecOffer = config.limits?.codecs ?? null;
    this.loadLanguages(config.languages ?? []);
    const modes = config.modes ?? [];
    if (modes.length < 2) return;
    this.modeSelect.replaceChildren(...modes.map((m) => {
      const option = document.createElement("option");
      option.value = m;
      option.textContent = MODE_NAMES[m] ?? m;
      return option;
    }));
    this.modeChoice.hidden = false;
    this.transcript.classList.add("engines");
  }

  mode() {
    return this.modeChoice.hidden ? null : this.modeSelect.value;
  }

  /** The server's languages (the first, "auto" where it detects, is the default): a choice
   * where it offers more than one, the last one picked remembered, with the Chinese script
   * and the digits toggle. */
  loadLanguages(languages) {
    if (languages.length < 2) return;
    this.languageSelect.replaceChildren(...languages.map(({ code, name }) => {
      const option = document.createElement("option");
      option.value = code;
      option.textContent = code === "auto" ? "Detect (auto)" : `${name[0].toUpperCase()}${name.slice(1)} (${code})`;
      return option;
    }));
    const remembered = (key) => globalThis.localStorage?.getItem(REMEMBERED[key]);
    const language = remembered("language");
    if (language && languages.some((l) => l.code === language)) this.languageSelect.value = language;
    if (remembered("script") === "hant") this.scriptSelect.value = "hant";
    this.formatBox.checked = remembered("format") === "1";
    this.languageChoice.hidden = false;
    this.formatChoice.hidden = false;
    this.showScript();
  }

  showScript() {
    this.scriptChoice.hidden = !["auto", "zh"].includes(this.languageSelect.value);
  }

  rememberChoices() {
    this.showScript();
    try {
      localStorage.setItem(REMEMBERED.language, this.languageSelect.value);
      localStorage.setItem(REMEMBERED.script, this.scriptSelect.value);
      localStorage.setItem(REMEMBERED.format, this.formatBox.checked ? "1" : "0");
      localStorage.setItem(REMEMBERED.diarize, this.speakersBox.checked ? "1" : "0");
    } catch {
      // storage off (private windows): the choice holds until the page is closed
    }
  }

  /** The session's options: mode, language, Chinese script, digits, speaker labels. */
  sessionOptions() {
    const offered = !this.languageChoice.hidden;
    return {
      token: pageToken(),
      mode: this.mode(),
      language: offered ? this.languageSelect.value : null,
      script: offered && !this.scriptChoice.hidden ? this.scriptSelect.value : null,
      format: offered && this.formatBox.checked,
      diarize: this.speakersBox.checked,
    };
  }

  /** The Opus bitrate the microphone's audio goes at, or 0 for PCM: Opus where the
   * server offers it and this browser's WebCodecs encodes it (at the server's first,
   * best, bitrate), unless the page's address asks for `?codec=pcm16`. */
  async opusBitrate() {
    await this.configLoaded;
    const asked = pageCodec();
    const bitrate = this.codecOffer?.opus?.bitrates?.[0];
    if (asked === "pcm16" || !bitrate) return 0;
    return (await opusSupported(bitrate)) ? bitrate : 0;
  }

  async copy() {
    try {
      await navigator.clipboard.writeText(this.view.text());
      this.showMessage("The transcript was copied.", "info");
    } catch {
      this.showError("clipboard");
    }
  }

  download(format) {
    const { render, type } = DOWNLOADS[format];
    const blob = new Blob([render(this.view.results)], { type: `${type};charset=utf-8` });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    const stamp = new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-");
    link.download = `transcript-${stamp}.${format}`;
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(link.href), 10000);
  }

  /** Decodes an audio file in the browser and sends it through the same session
   * protocol as the microphone, as 200 ms chunks at the rate the server allows. */
  async transcribeFile(file) {
    if (this.state !== "idle") return;
    this.setState("starting");
    this.message.hidden = true;
    this.errorShown = false;
    let pcm;
    try {
      pcm = await decodeFile(file);
    } catch {
      this.showMessage(`“${file.name}” ${MESSAGES.not_audio}`, "error");
      this.errorShown = true;
      this.setState("idle");
      return;
    }
    const stream = new SpeechStream(this.streamHandlers(), this.sessionOptions());
    this.stream = stream;
    this.rate = FILE_RATE;
    this.audio.textContent = `${kHz(FILE_RATE)} · file`;
    this.showMessage(`Transcribing “${file.name}” (${(pcm.length / FILE_RATE).toFixed(1)} s of audio)…`, "info");
    stream.open();
    this.setState("recording");
    this.fileSending = true;
    const size = (FILE_RATE * CHUNK_MS) / 1000;
    const started = performance.now();
    let sentMs = 0;
    for (let at = 0; at < pcm.length || at === 0; at += size) {
      if (this.stream !== stream || !this.fileSending) return; // an error, or Stop
      const chunk = pcm.subarray(at, at + size);
      const last = at + size >= pcm.length;
      stream.send({ pcm: Int16Array.from(chunk), sampleRate: FILE_RATE, last });
      this.showLevel(chunk);
      sentMs += CHUNK_MS;
      const factor = stream.session?.limits?.rate_limit_factor;
      const speed = factor === 0 ? FILE_UNLIMITED_SPEED : (factor ?? 1) * FILE_RATE_SHARE;
      const wait = started + sentMs / speed - performance.now();
      if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
      if (last) break;
    }
    this.fileSending = false;
    this.setState("finishing");
    if (await this.finish(stream, END_TIMEOUT_MS + pcm.length / FILE_RATE * 1000)) {
      this.message.hidden = true; // "Transcribing …" is done
    }
  }

  setState(state) {
    this.state = state;
    document.body.dataset.state = state;
    const recording = state === "recording";
    this.button.setAttribute("aria-pressed", String(recording));
    // aria-disabled rather than disabled: a disabled button would drop keyboard focus.
    this.button.setAttribute("aria-disabled", String(state === "starting" || state === "finishing"));
    this.label.textContent = { idle: "Start", starting: "Starting…", recording: "Stop", finishing: "Finishing…" }[state];
    if (state === "idle") this.level.style.setProperty("--level", "0");
  }

  /** A `load` event: the server spaces this session's partials out (or no longer). */
  showLoad(load) {
    const seconds = load.partial_interval_ms / 1000;
    this.busy.textContent = `busy: live text every ${Number.isInteger(seconds) ? seconds : seconds.toFixed(1)} s`;
    this.busy.hidden = !load.busy;
  }

  setConnection(state, text) {
    this.connection.dataset.state = state;
    this.connection.textContent = text;
  }

  showMessage(text, kind = "error") {
    this.message.textContent = text;
    this.message.dataset.kind = kind;
    this.message.hidden = false;
  }

  showError(code, detail) {
    const text = MESSAGES[code] ?? `The server reported an error (${code}).`;
    this.showMessage(detail ? `${text} (${detail})` : text, "error");
    this.errorShown = true;
  }

  async start() {
    this.setState("starting");
    this.message.hidden = true;
    this.latency.textContent = "–";
    this.rate = INITIAL_RATE;
    this.errorShown = false;
    const bitrate = await this.opusBitrate();
    // A page that encodes Opus follows the server's switches between PCM and Opus rungs.
    const stream = new SpeechStream(this.streamHandlers(), { ...this.sessionOptions(), bitrate, abr: bitrate > 0 });
    this.held = null;
    const mic = new Microphone((chunk) => this.onChunk(chunk));
    this.stream = stream;
    this.mic = mic;
    this.encoder = bitrate ? new OpusChunker(bitrate, (chunk) => this.stream?.send(chunk)) : null;
    if (bitrate) this.rate = OPUS_RATE;
    try {
      await mic.start(this.rate);
    } catch (err) {
      this.mic = this.stream = null;
      this.showError(err.reason ?? "failed");
      this.setState("idle");
      return;
    }
    mic.onEnded = () => {
      if (this.state === "recording") {
        this.showError("ended");
        this.stop();
      }
    };
    this.showAudio();
    stream.open();
    this.setState("recording");
  }

  async stop() {
    const { mic, stream } = this;
    if (!mic) { // a file: stop sending it and end the session with what was sent
      this.fileSending = false;
      this.setState("finishing");
      stream.send({ pcm: new Int16Array(0), sampleRate: FILE_RATE, last: true });
      await this.finish(stream, END_TIMEOUT_MS);
      return;
    }
    this.setState("finishing");
    await mic.finish(); // the worklet's last chunk goes out through onChunk with last=true
    while (this.held) await new Promise((resolve) => setTimeout(resolve, 20)); // a switch to PCM
    await this.encoder?.finish(); // the encoder's last packets go out with last=true
    this.encoder = null;
    await this.finish(stream, END_TIMEOUT_MS);
  }

  /** After the last chunk: waits for the server's `end`, says if it did not come, and
   * closes. True when `end` came (false also when a fatal error closed it meanwhile). */
  async finish(stream, timeoutMs) {
    const ended = await stream.waitEnd(timeoutMs);
    if (stream !== this.stream) return false; // a fatal error already closed this recording
    if (!ended) this.showError("timeout");
    await this.close();
    return ended;
  }

  async close() {
    const { mic, stream } = this;
    this.mic = this.stream = null;
    this.encoder = null;
    this.busy.hidden = true;
    mic?.release();
    this.setState("idle");
    await stream?.close();
  }

  onChunk(chunk, level = true) {
    if (this.held) {
      this.held.push(chunk); // the encoder is draining before PCM takes over
    } else if (this.encoder) {
      // the last PCM chunk is encoded too; the encoder's finish() sends `last`
      this.encoder.encode(chunk.pcm);
    } else {
      this.stream?.send(chunk);
    }
    if (level) this.showLevel(chunk.pcm);
  }

  showLevel(pcm) {
    let sum = 0;
    for (const v of pcm) sum += v * v;
    const rms = pcm.length ? Math.sqrt(sum / pcm.length) / 32768 : 0;
    // Roughly -60..0 dBFS onto 0..1 for the level bar.
    const level = Math.max(0, Math.min(1, 1 + Math.log10(rms + 1e-9) / 3));
    this.level.style.setProperty("--level", level.toFixed(2));
  }

  streamHandlers() {
    return {
      state: (state, detail) => this.onConnectionState(state, detail),
      session: (info, kind) => this.onSession(info, kind),
      text: (result, latencyMs) => this.onText(result, latencyMs),
      relabel: (change) => this.view.relabel(change.utterance, change.speaker, change.spans),
      rungSwitch: (rung, direction) => this.onRungSwitch(rung, direction),
      load: (load) => this.showLoad(load),
      error: (err, fatal) => this.onServerError(err, fatal),
      end: () => {},
    };
  }

  onConnectionState(state, detail) {
    const text = {
      connecting: "Connecting…",
      connected: "Connected",
      reconnecting: detail ? `Connection lost · reconnecting (${detail}/${RECONNECT_ATTEMPTS})…` : "Connection lost · reconnecting…",
      disconnected: "Disconnected",
      failed: "Server unreachable",
      refused: "Refused",
      closed: "Not connected",
    }[state];
    this.setConnection(state, text);
    if ((state === "disconnected" || state === "refused") && this.stream) {
      // The server closes after refusing a connection; its error said why already.
      if (!this.errorShown) this.showError(state === "refused" ? "refused" : "closed");
      this.close();
    }
  }

  onSession(info, kind) {
    this.setConnection("connected", `Connected · ${kHz(info.rate)}`);
    this.sessionInfo.textContent = info.id.slice(0, 8);
    this.sessionInfo.title = info.id;
    if (this.stream?.abr && info.abr && info.codec) this.useRung({ codec: info.codec, bitrate: info.bitrate });
    else if (info.rate !== this.rate) this.useRate(info.rate);
    if (kind === "resumed") {
      this.showMessage("Reconnected: the session continues where it left off.", "info");
    } else if (kind === "restarted") {
      this.showMessage("The connection dropped and the session could not be resumed, so a new session started. "
        + "The text so far is kept; words spoken around the drop may be missing.", "info");
    }
  }

  useRate(rate) {
    if (this.encoder) return; // Opus is 16 kHz whatever the session's PCM rate
    this.rate = rate;
    this.mic?.setRate(rate);
    this.showAudio();
  }

  /** The rates and the codec in use: "16 kHz · mic 48 kHz · Opus 32 kbit/s". */
  showAudio() {
    const device = this.mic?.deviceRate;
    const codec = codecName(this.encoder?.bitrate ?? 0);
    this.audio.textContent = device ? `${kHz(this.rate)} · mic ${kHz(device)} · ${codec}` : kHz(this.rate);
  }

  /** Sends the microphone's audio at `rung` ({codec, bitrate}) from the next chunk on: a
   * new bitrate for the encoder, a new encoder, or PCM once the encoder's last packets
   * went out (chunks captured meanwhile wait, so the audio stays in order). */
  async useRung(rung) {
    if (rung.codec === "opus") {
      if (this.encoder) this.encoder.setBitrate(rung.bitrate);
      else if (!this.held) this.encoder = new OpusChunker(rung.bitrate, (chunk) => this.stream?.send(chunk));
    } else if (this.encoder && !this.held) {
      const encoder = this.encoder;
      this.held = [];
      await encoder.drain();
      this.encoder = null;
      const held = this.held;
      this.held = null;
      for (const chunk of held) this.onChunk(chunk, false);
    }
    this.showAudio();
  }

  onRungSwitch(rung, direction) {
    if (!this.stream?.abr || !this.mic) return;
    this.useRung(rung);
    const why = direction === "down" ? "The network is slow" : "The network has room again";
    this.showMessage(`${why}: now sending ${codecName(rung.codec === "opus" ? rung.bitrate : 0)}.`, "info");
  }

  onText(result, latencyMs) {
    if (result.type === "partial") {
      this.view.showPartial(result.text, result.utterance, result.speaker);
      return;
    }
    this.view.addFinal(result);
    if (latencyMs !== null) this.latency.textContent = `${Math.round(latencyMs)} ms`;
  }

  onServerError(err, fatal) {
    if (err.code === "overloaded" && err.retry_after_ms) {
      this.showError("overloaded", `try again in ${Math.ceil(err.retry_after_ms / 1000)} s`);
    } else {
      this.showError(err.code, OWN_WORDS.has(err.code) ? null : err.msg);
    }
    if (fatal && this.stream) this.close();
  }
}

/** A file's first audio track, mixed down to mono and resampled to 16 kHz by the
 * browser's own decoder (WebAudio `decodeAudioData`), as 16-bit samples. */
async function decodeFile(file) {
  const bytes = await file.arrayBuffer();
  const context = new OfflineAudioContext(1, 1, FILE_RATE);
  const decoded = await context.decodeAudioData(bytes);
  const frames = Math.max(1, Math.ceil(decoded.duration * FILE_RATE));
  const render = new OfflineAudioContext(1, frames, FILE_RATE);
  const source = render.createBufferSource();
  source.buffer = decoded;
  source.connect(render.destination);
  source.start();
  const samples = (await render.startRendering()).getChannelData(0);
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    pcm[i] = Math.max(-32768, Math.min(32767, Math.round(samples[i] * 32768)));
  }
  return pcm;
}

new App(document);

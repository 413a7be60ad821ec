"use strict";
const RATE = 24000, FORMAT = { type: "audio/pcm", rate: RATE };
const $ = (id) => document.getElementById(id);
// for tests and curious users: event counts, audio samples received (all, by answer) / played / dropped at
// barge-in, the last truncate's audio_end_ms, the last turn's timings (the page's; the server's by response
// id: turns.js), the user's transcripts by item id, the image items the server added (attach.js), errors,
// extra session fields (e.g. max_audio_frames) for Start
const omni = window.omni = {
  events: {}, deltas: 0, samples: 0, answers: {}, played: 0, dropped: 0, heard: null, lastTurn: null,
  server: {}, transcripts: {}, images: [], errors: [], session: {} };
let model = null, ws = null, ctx = null, mic = null, player = null;
// the answer in the player, the response being made, the turn being timed, when push-to-talk was pressed
let playing = null, responding = null, turn = null, held = null;
const entries = new Map();
const listeners = [];  // more handlers of every server event (attach.js)

function headers() { return $("key").value ? { Authorization: "Bearer " + $("key").value } : {}; }

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) throw new Error((await r.json()).error?.message || r.statusText);
  model = (await r.json()).data[0];
  $("model").textContent = $("model").title = model.id;
  $("random").hidden = !model.random_weights;
  $("voice").replaceChildren(...(model.voices || []).map((v) => new Option(v)));
}

function say(text, cls, id) {
  const li = document.createElement("li");
  li.className = cls; li.textContent = text;
  $("log").append(li);
  if (id) { entries.set(id, li); li.dataset.item = id; }
  return li;
}

function fail(message) { omni.errors.push(message); say(`Error: ${message}`, "error"); }

const b64 = (buf) => btoa(String.fromCharCode(...new Uint8Array(buf)));
function pcm(b64text) {
  const bytes = Uint8Array.from(atob(b64text), (c) => c.charCodeAt(0));
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

function schedule(itemId, samples) {
  if (playing?.id !== itemId) playing = { id: itemId, samples: 0 };
  playing.samples += samples.length;
  omni.deltas++; omni.samples += samples.length;
  omni.answers[itemId] = (omni.answers[itemId] || 0) + samples.length;
  player.port.postMessage(samples, [samples.buffer]);
}

function bargeIn() {  // the user spoke: the player drops what it holds (then onPlayer truncates)
  if (!playing) return;
  player.port.postMessage({ clear: playing });
  omni.cut = playing.id; playing = null;
}

function onPlayer({ data }) {  // tell the server how much of a cut answer was heard
  omni.played += data.played;
  if (!data.dropped) return;
  omni.dropped += data.dropped;
  omni.heard = Math.floor(Math.max(0, data.item.samples - data.dropped) * 1000 / RATE);
  send({ type: "conversation.item.truncate", item_id: data.item.id, content_index: 0,
         audio_end_ms: omni.heard });
}

function user(id, seconds) {  // the user's line: the transcript (once there is one) and the speech's length
  const li = entries.get(id) || say("", "user", id);
  if (seconds !== undefined) li.dataset.len = `(${seconds.toFixed(1)} s of speech)`;
  li.textContent = [li.dataset.said?.trim(), li.dataset.len || "…"].filter(Boolean).join(" ");
  return li;
}

function said(id, text) {
  if (!entries.has(id)) return null;
  entries.get(id).dataset.said = text;
  return user(id);
}

function send(event) { if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(event)); }

const handlers = {
  "session.updated": () => { $("status").textContent = listening(); },
  "input_audio_buffer.speech_started": (e) => {
    bargeIn();
    user(e.item_id).dataset.start = e.audio_start_ms;
  },
  "input_audio_buffer.speech_stopped": (e) => {
    turn = { decided: performance.now(), how: "VAD", samples: 0 };
    const li = entries.get(e.item_id);
    if (li) user(e.item_id, (e.audio_end_ms - li.dataset.start) / 1000);
  },
  "input_audio_buffer.committed": (e) => {
    if (turn?.speech && !entries.has(e.item_id)) user(e.item_id, turn.speech);
  },
  "conversation.item.input_audio_transcription.delta": (e) => {
    said(e.item_id, (entries.get(e.item_id)?.dataset.said || "") + e.delta);
  },
  "conversation.item.input_audio_transcription.completed": (e) => {
    omni.transcripts[e.item_id] = e.transcript;
    said(e.item_id, e.transcript)?.classList.add("heard");
  },
  "conversation.item.input_audio_transcription.failed": (e) => fail(`transcription: ${e.error.message}`),
  "response.created": (e) => {
    responding = e.response.id;
    if (turn && !turn.response) turn.response = e.response.id;
  },
  "response.output_item.added": (e) => { if (e.item.role === "assistant") say("", "assistant", e.item.id); },
  "response.output_audio.delta": (e) => {
    const samples = pcm(e.delta);
    timeAudio(e, samples.length);
    if (e.item_id !== omni.cut) schedule(e.item_id, samples);
  },
  "response.output_audio_transcript.delta": (e) => {
    const li = entries.get(e.item_id);
    if (li) li.textContent += e.delta;
  },
  "conversation.item.truncated": (e) => entries.get(e.item_id)?.classList.add("cut"),
  "response.done": (e) => {
    if (responding === e.response.id) responding = null;
    showTurn(e);
    $("status").textContent = `${listening()} (last answer: ${e.response.status})`;
  },
  "error": (e) => fail(e.error.message),
};

const ptt = () => $("ptt").checked;
const listening = () => (ptt() ? "Hold the button (or the space bar) and speak." : "Listening…");
const turnDetection = () => (ptt() ? null : { type: "server_vad" });

function press() {  // push-to-talk: stop the answer (here and on the server), start a fresh input buffer
  if (!ws || !ptt() || held !== null) return;
  bargeIn();
  if (responding) send({ type: "response.cancel", response_id: responding });
  send({ type: "input_audio_buffer.clear" });
  held = performance.now();
  $("talk").setAttribute("aria-pressed", "true");
}

function release() {
  if (held === null) return;
  const now = performance.now();
  turn = { decided: now, how: "release", samples: 0, speech: (now - held) / 1000 };
  held = null;
  $("talk").setAttribute("aria-pressed", "false");
  send({ type: "input_audio_buffer.commit" });
  send({ type: "response.create" });
}

async function start() {
  $("status").textContent = "Connecting…";
  await loadModel();
  if (!window.isSecureContext) throw new Error("the microphone needs https or localhost (e.g. ssh -L)");
  ctx = new AudioContext({ sampleRate: RATE });  // NOTE: the browser resamples the microphone to 24 kHz
  await ctx.audioWorklet.addModule("/page/worklets.js");
  mic = { stream: await navigator.mediaDevices.getUserMedia(
    { audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true } }) };
  player = new AudioWorkletNode(ctx, "player", { numberOfInputs: 0, outputChannelCount: [1] });
  player.port.onmessage = onPlayer;
  player.connect(ctx.destination);
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime`
    + `?model=${encodeURIComponent(model.id)}`;
  // NOTE: a browser cannot set an Authorization header on a WebSocket; the key rides in a subprotocol.
  const key = $("key").value;
  ws = new WebSocket(url, key ? ["realtime", "openai-insecure-api-key." + key] : []);
  ws.onopen = () => {
    const output = $("voice").value ? { voice: $("voice").value } : {};
    send({ type: "session.update", session: { type: "realtime", output_modalities: ["audio"],
      instructions: $("instructions").value, ...omni.session,
      audio: { input: { format: FORMAT, turn_detection: turnDetection(), transcription: { model: model.id } },
               output: { format: FORMAT, ...output } } } });
    onSession();
    mic.node = new AudioWorkletNode(ctx, "mic", { numberOfOutputs: 0 });
    mic.node.port.onmessage = (m) => {
      if (!ptt() || held !== null) send({ type: "input_audio_buffer.append", audio: b64(m.data) });
    };
    ctx.createMediaStreamSource(mic.stream).connect(mic.node);
  };
  ws.onmessage = (m) => {
    const e = JSON.parse(m.data);
    omni.events[e.type] = (omni.events[e.type] || 0) + 1;
    handlers[e.type]?.(e);
    for (const f of listeners) f(e);
  };
  ws.onclose = (e) => {
    stop();
    $("status").textContent = `Closed (${e.code}${e.reason ? ": " + e.reason : ""}).`;
  };
  $("start").textContent = "Stop";
}

function stop() {
  if (ws) { ws.onclose = null; ws.close(); ws = null; }
  mic?.stream.getTracks().forEach((t) => t.stop());
  ctx?.close();
  mic = ctx = player = playing = responding = turn = held = null;
  $("start").textContent = "Start";
  $("status").textContent = "Stopped.";
}

function update(session) { send({ type: "session.update", session: { type: "realtime", ...session } }); }

const typing = (e) => e.target.matches("input[type=text], input[type=password], select, textarea");
const space = (e) => e.code === "Space" && ptt() && ws && !typing(e);
document.addEventListener("keydown", (e) => {
  if (space(e)) { e.preventDefault(); if (!e.repeat) press(); }
});
document.addEventListener("keyup", (e) => { if (space(e)) { e.preventDefault(); release(); } });
$("talk").onpointerdown = press;
$("talk").onpointerup = $("talk").onpointerleave = release;
$("ptt").onchange = () => {
  $("talk").hidden = !ptt();
  update({ audio: { input: { turn_detection: turnDetection() } } });
};
$("instructions").onchange = () => update({ instructions: $("instructions").value });
$("form").onsubmit = async (ev) => {
  ev.preventDefault();
  if (ws) return stop();
  $("start").disabled = true;
  try { await start(); } catch (err) { stop(); fail(err.message); } finally { $("start").disabled = false; }
};
$("key").onchange = () => loadModel().catch((err) => fail(err.message));
loadModel().catch(() => { $("status").textContent = "Enter the API key, then press Start."; });

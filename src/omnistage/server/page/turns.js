// The last turn's timings. The page's own: the VAD decision (or the key let go) -> the first audio delta, and
// the RTF of the answer's deltas. The server's: what it measured where it sent the events (response.done's
// metadata): speech_stopped -> first audio, response.created -> first audio, RTF.
"use strict";

function timeAudio(e, samples) {  // the turn's answer: first and last audio delta, its audio
  if (!turn || e.response_id !== turn.response) return;
  turn.first ??= performance.now();
  turn.last = performance.now(); turn.samples += samples;
}

function showTurn(e) {
  showServer(e.response);
  if (!turn || e.response.id !== turn.response || !turn.first) return;
  const audio = turn.samples / RATE;
  omni.lastTurn = { response_id: turn.response, first_audio_ms: turn.first - turn.decided, audio_s: audio,
                    rtf: (turn.last - turn.first) / 1000 / audio };
  const { first_audio_ms: ms, rtf } = omni.lastTurn;
  $("turn").textContent = `Last turn: ${turn.how} → first audio ${ms.toFixed(0)} ms; `
    + `RTF ${rtf.toFixed(2)} (${audio.toFixed(1)} s of audio in ${(rtf * audio).toFixed(1)} s)`;
}

function showServer(response) {
  const m = response.metadata || {};
  if (!("omnistage_rtf" in m)) return;  // no audio went out
  const number = (key) => (key in m ? Number(m[key]) : null);
  const s = omni.server[response.id] = { vad_to_first_audio_ms: number("omnistage_vad_to_first_audio_ms"),
    first_audio_ms: number("omnistage_first_audio_ms"), rtf: number("omnistage_rtf") };
  const vad = s.vad_to_first_audio_ms === null ? ""
    : `VAD decision → first audio ${s.vad_to_first_audio_ms.toFixed(0)} ms; `;
  $("server").textContent = `Server, last turn: ${vad}response.created → first audio `
    + `${s.first_audio_ms.toFixed(0)} ms; RTF ${s.rtf.toFixed(2)}`;
}

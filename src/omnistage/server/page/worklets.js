// The page's audio threads. "mic": the microphone as pcm16, 40 ms a message. "player": a ring of received
// pcm16 samples, played at once and gapless (silence while empty); it posts back how many it played, and on
// {clear} drops the rest and says how many it dropped.
"use strict";
const CHUNK = sampleRate / 25;
const START = Math.ceil(0.05 * sampleRate / 128);  // render quanta of silence before a sound starts (jitter)

registerProcessor("mic", class extends AudioWorkletProcessor {
  constructor() { super(); this.buf = new Int16Array(CHUNK); this.n = 0; }
  process([input]) {
    for (const x of input[0] || []) {
      this.buf[this.n++] = Math.max(-1, Math.min(1, x)) * 32767;
      if (this.n === this.buf.length) {
        this.port.postMessage(this.buf.buffer, [this.buf.buffer]);
        this.buf = new Int16Array(CHUNK); this.n = 0;
      }
    }
    return true;
  }
});

registerProcessor("player", class extends AudioWorkletProcessor {
  constructor() {
    super();
    this.ring = new Int16Array(1 << 20);  // 44 s; read and write count samples: index = count % size
    this.read = 0; this.write = 0;
    this.wait = 0; this.played = 0;
    this.port.onmessage = ({ data }) => {
      if (data instanceof Int16Array) this.push(data); else this.clear(data.clear);
    };
  }
  push(samples) {
    if (this.write === this.read) this.wait = START;
    if (this.write - this.read + samples.length > this.ring.length) this.grow(samples.length);
    for (const s of samples) this.ring[this.write++ % this.ring.length] = s;
  }
  grow(more) {  // keep every sample: the page counts each one as played or dropped
    const ring = new Int16Array(2 ** Math.ceil(Math.log2(this.write - this.read + more)));
    for (let i = this.read; i < this.write; i++) ring[i % ring.length] = this.ring[i % this.ring.length];
    this.ring = ring;
  }
  clear(item) {
    this.port.postMessage({ played: this.played, dropped: this.write - this.read, item });
    this.read = this.write; this.played = 0;
  }
  process(inputs, [output]) {
    const out = output[0], n = this.wait > 0 ? 0 : Math.min(out.length, this.write - this.read);
    this.wait = Math.max(0, this.wait - 1);
    for (let i = 0; i < n; i++) out[i] = this.ring[this.read++ % this.ring.length] / 32768;
    this.played += n;
    if (this.played && (this.read === this.write || this.played >= CHUNK * 4)) {
      this.port.postMessage({ played: this.played }); this.played = 0;
    }
    return true;
  }
});

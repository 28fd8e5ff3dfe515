// Voice maker: the "Make a voice" section of the page (index.html). Record with the
// microphone or pick a file; the browser turns either into a 16-bit mono WAV, the server checks
// it (voices/check), a Wyoming speech-to-text server fills in the transcript when one is set up
// (voices/transcribe), the user listens to it, names it and saves it (voices/custom), and the
// server offers it at once. Only relative URLs: the page also runs under Home Assistant's
// ingress prefix. window.voiceMaker exposes the state for tests and the curious.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const maker = window.voiceMaker = {
    info: null, recording: false, seconds: 0, peak: 0, wav: null, checked: null, quality: null,
    transcript: null, transcribing: false, saved: null, state: null, reloaded: null, error: null,
  };
  const UNREACHABLE = "Cannot reach the server. Check that it is running, then try again.";
  const NO_MICROPHONE = "The browser allows the microphone only on pages opened over https:// " +
    "(or on this computer itself). Upload a recording instead, or open Home Assistant over https.";
  // Runs on the audio thread: hands each block of microphone samples to the page.
  const TAP = "registerProcessor('tap', class extends AudioWorkletProcessor {" +
    " process(inputs) { if (inputs[0].length) this.port.postMessage(inputs[0]); return true; } });";
  let capture = null;  // the recording in progress: context, stream, blocks, rate
  let audioUrl = null;
  let transcriptTouched = false;  // the user typed: a late transcript must not overwrite it

  function say(text, kind = "") {
    $("maker-status").textContent = text;
    $("maker-status").className = kind;
    if (kind === "error") maker.error = text;
  }

  function busy(on) {
    for (const id of ["record", "upload", "save"]) $(id).disabled = on;
    if (!on) updateSave();
    if (!window.isSecureContext || !navigator.mediaDevices) $("record").disabled = true;
    if (maker.info && !maker.info.saving) $("save").disabled = true;
  }

  // POST JSON, answer {ok, status, data}; data.error.message is written for people.
  async function post(path, body) {
    let response;
    try {
      response = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
                                     body: body === undefined ? "{}" : JSON.stringify(body) });
    } catch {
      return { ok: false, status: 0, data: { error: { message: UNREACHABLE } } };
    }
    let data = {};
    try { data = await response.json(); } catch { /* not JSON */ }
    return { ok: response.ok, status: response.status, data };
  }

  function problem(result) {
    const error = result.data && result.data.error;
    if (result.status === 413) return "The recording is too large: make it shorter (at most " +
                                      `${maker.info.max_seconds} s).`;
    return (error && error.message) || `The server refused the request (${result.status}).`;
  }

  // --- audio in the browser ----------------------------------------------------------------

  function mixToMono(channels) {
    if (channels.length === 1) return Float32Array.from(channels[0]);
    const mono = new Float32Array(channels[0].length);
    for (const channel of channels) for (let i = 0; i < mono.length; i++) mono[i] += channel[i];
    for (let i = 0; i < mono.length; i++) mono[i] /= channels.length;
    return mono;
  }

  function wavBlob(samples, rate) {
    const view = new DataView(new ArrayBuffer(44 + 2 * samples.length));
    const text = (at, s) => { for (let i = 0; i < s.length; i++) view.setUint8(at + i, s.charCodeAt(i)); };
    text(0, "RIFF"); view.setUint32(4, 36 + 2 * samples.length, true); text(8, "WAVE");
    text(12, "fmt "); view.setUint32(16, 16, true); view.setUint16(20, 1, true);
    view.setUint16(22, 1, true); view.setUint32(24, rate, true); view.setUint32(28, 2 * rate, true);
    view.setUint16(32, 2, true); view.setUint16(34, 16, true);
    text(36, "data"); view.setUint32(40, 2 * samples.length, true);
    for (let i = 0; i < samples.length; i++) {
      const s = Math.max(-1, Math.min(1, samples[i]));
      view.setInt16(44 + 2 * i, Math.round(s * 32767), true);
    }
    return new Blob([view], { type: "audio/wav" });
  }

  function dataUrl(blob) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(blob);
    });
  }

  async function startRecording() {
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: {
        channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
    } catch (err) {
      say(`The microphone cannot be used: ${err.message || err.name}. Allow it for this page, ` +
          "or upload a recording instead.", "error");
      return;
    }
    const context = new AudioContext();
    const url = URL.createObjectURL(new Blob([TAP], { type: "text/javascript" }));
    let node;
    try {
      await context.audioWorklet.addModule(url);
      node = new AudioWorkletNode(context, "tap");
    } catch (err) {
      stream.getTracks().forEach((track) => track.stop());
      context.close();
      say(`This browser cannot record here (${err.message || err.name}); upload a recording ` +
          "instead.", "error");
      return;
    } finally {
      URL.revokeObjectURL(url);
    }
    capture = { context, stream, blocks: [], frames: 0, rate: context.sampleRate };
    maker.peak = 0;
    node.port.onmessage = (event) => {
      if (!capture) return;
      const block = mixToMono(event.data);
      capture.blocks.push(block);
      capture.frames += block.length;
      let peak = 0;
      for (const s of block) peak = Math.max(peak, Math.abs(s));
      maker.peak = Math.max(maker.peak, peak);
      // a meter that falls back by half in about a third of a second, as level meters do
      const fall = Math.pow(0.5, block.length / (0.3 * capture.rate));
      $("level").value = Math.max(peak, $("level").value * fall);
      maker.seconds = capture.frames / capture.rate;
      $("rec-time").textContent = `${maker.seconds.toFixed(1)} s`;
      if (maker.seconds >= maker.info.max_seconds) stopRecording();
    };
    context.createMediaStreamSource(stream).connect(node);
    node.connect(context.destination);  // pulled by the graph; it outputs silence
    maker.recording = true;
    $("record").textContent = "Stop";
    $("upload").disabled = true;
    say("Recording… Speak clearly, then press Stop (5–10 s is best).");
  }

  async function stopRecording() {
    const done = capture;
    capture = null;
    maker.recording = false;
    $("record").textContent = "Record";
    done.stream.getTracks().forEach((track) => track.stop());
    await done.context.close();
    const samples = new Float32Array(done.frames);
    let at = 0;
    for (const block of done.blocks) { samples.set(block, at); at += block.length; }
    await useRecording(samples, done.rate);
  }

  async function openFile(file) {
    say("Reading the file…");
    const context = new AudioContext();
    let buffer;
    try {
      buffer = await context.decodeAudioData(await file.arrayBuffer());
    } catch {
      say("The browser cannot read this file. Convert it to WAV and try again.", "error");
      return;
    } finally {
      context.close();
    }
    if (buffer.duration > maker.info.max_seconds + 1) {
      say(`The recording is ${buffer.duration.toFixed(1)} s long; the limit is ` +
          `${maker.info.max_seconds} s. Cut it to 5–10 s of clear speech.`, "error");
      return;
    }
    const channels = [];
    for (let c = 0; c < buffer.numberOfChannels; c++) channels.push(buffer.getChannelData(c));
    await useRecording(mixToMono(channels), buffer.sampleRate);
  }

  // --- the server's part -------------------------------------------------------------------

  async function useRecording(samples, rate) {
    Object.assign(maker, { checked: null, saved: null, state: null, error: null, reloaded: null,
                           transcript: null });
    transcriptTouched = false;  // a new recording: its own transcript
    $("after-save").hidden = true;
    const blob = wavBlob(samples, rate);
    maker.wav = await dataUrl(blob);
    if (audioUrl) URL.revokeObjectURL(audioUrl);
    audioUrl = URL.createObjectURL(blob);
    $("preview").src = audioUrl;
    $("preview").hidden = false;
    busy(true);
    say("Checking the recording…");
    const result = await post("voices/check", { audio: maker.wav });
    busy(false);
    if (!result.ok) { say(problem(result), "error"); updateSave(); return; }
    maker.checked = result.data;
    const r = result.data;
    const quality = `Good recording: ${r.duration_s.toFixed(1)} s, the speech ` +
      `${Math.round(r.snr_db)} dB above the background. Listen to it below.`;
    say([quality, ...r.advice].join(" "), "ok");
    updateSave();
    maker.quality = quality;
    if (maker.info.speech_to_text) await transcribe(quality);
  }

  async function transcribe(quality) {
    maker.transcribing = true;
    $("transcript").placeholder = "Transcribing…";
    const language = $("maker-language").value;
    const result = await post("voices/transcribe", { audio: maker.wav, language });
    maker.transcribing = false;
    $("transcript").placeholder = "Exactly the words spoken in the recording";
    if (!result.ok) {
      say(`${quality} The transcript could not be filled in (${problem(result)}). Type what is ` +
          "said in the recording.", "ok");
      return;
    }
    maker.transcript = result.data.transcript;
    if (!transcriptTouched || !$("transcript").value.trim()) {
      $("transcript").value = result.data.transcript;
      transcriptTouched = false;
    }
    say(`${quality} Check the transcript: it must be exactly what is said.`, "ok");
    updateSave();
  }

  function updateSave() {
    $("save").disabled = !(maker.checked && maker.info && maker.info.saving &&
                           $("voice-name").value.trim() && $("transcript").value.trim());
  }

  async function save() {
    const name = $("voice-name").value.trim();
    busy(true);
    say(`Saving ${name}…`);
    const result = await post("voices/custom", { name, transcript: $("transcript").value,
                                                 audio: maker.wav });
    busy(false);
    if (!result.ok) { say(problem(result), "error"); return; }
    maker.saved = name;
    await follow(result.data);
  }

  // Shows the saved voice's state; while the server still analyses it, asks again.
  async function follow(state) {
    for (;;) {
      maker.state = state.state;
      if (state.state === "offered") { offered(state.name); return; }
      if (state.state === "rejected") {
        say(`The voice was saved, but the server does not offer it: ${state.reason}.`, "error");
        return;
      }
      say(`Saved. The server is preparing the voice (${state.reason}); this page updates ` +
          "when it is ready.");
      await new Promise((resolve) => setTimeout(resolve, 2000));
      let response;
      try {
        response = await fetch(`voices/custom/${encodeURIComponent(state.name)}`, { cache: "no-store" });
      } catch { continue; }  // the server restarts: ask again
      if (response.ok) {
        state = await response.json();
      } else if (response.status !== 503) {
        say(problem({ status: response.status, data: await response.json().catch(() => ({})) }),
            "error");
        return;
      }
    }
  }

  function offered(name) {
    const select = $("voice");
    if (select && ![...select.options].some((o) => o.value === name)) {
      const option = new Option(`${name} — ${name} (custom voice)`, name);
      option.title = option.text;
      select.add(option);
    }
    say(`The voice ${name} is ready.`, "ok");
    $("after-save").hidden = false;
    $("ha-reload").hidden = !maker.info.home_assistant;
    $("ha-manual").hidden = Boolean(maker.info.home_assistant);
  }

  function speakWithIt() {
    $("voice").value = maker.saved;
    $("text").scrollIntoView({ block: "center" });
    $("speak").click();
  }

  async function reloadHomeAssistant() {
    $("reload-ha").disabled = true;
    say("Asking Home Assistant to reload the Wyoming integration…");
    const result = await post("voices/home-assistant/reload");
    $("reload-ha").disabled = false;
    if (!result.ok) { say(problem(result), "error"); return; }
    maker.reloaded = result.data.reloaded;
    say(`Home Assistant reloaded ${result.data.reloaded.join(", ")}: the voice ${maker.saved} ` +
        "is in its voice list now.", "ok");
  }

  async function init() {
    let response;
    try { response = await fetch("voices/maker"); } catch { return; }
    if (!response.ok) return;  // an older server: no voice maker
    maker.info = await response.json();
    $("maker").hidden = false;
    if (!maker.info.voices_folder) {
      say("This server has no voices folder (start it with --voices-dir), so voices cannot be " +
          "saved here; recordings can still be checked.");
    } else if (!maker.info.saving) {
      say("Saving voices from this page is off on this server (start it with " +
          "--web-voice-maker); recordings can still be checked.");
    } else if (!window.isSecureContext || !navigator.mediaDevices) {
      say(NO_MICROPHONE);
    }
    busy(false);
    $("record").addEventListener("click", () => (capture ? stopRecording() : startRecording()));
    $("upload").addEventListener("click", () => $("file").click());
    $("file").addEventListener("change", () => {
      const file = $("file").files[0];
      $("file").value = "";
      if (file) openFile(file);
    });
    $("transcript").addEventListener("input", () => { transcriptTouched = true; updateSave(); });
    $("voice-name").addEventListener("input", updateSave);
    // Another language for speech-to-text: ask again, unless the user has typed meanwhile.
    $("maker-language").addEventListener("change", () => {
      if (maker.checked && maker.info.speech_to_text && !maker.transcribing &&
          (!transcriptTouched || !$("transcript").value.trim())) transcribe(maker.quality);
    });
    $("save").addEventListener("click", save);
    $("speak-with-it").addEventListener("click", speakWithIt);
    $("reload-ha").addEventListener("click", reloadHomeAssistant);
  }

  init();
})();

// tokenmill's chat page: plain JavaScript, no dependencies. It talks to the server it was loaded from:
// GET /v1/models for the model's name, and one streamed POST /v1/chat/completions per answer, read with
// fetch + ReadableStream (Server-Sent Events). Stop aborts the fetch: the server sees the connection
// close and aborts the engine request. The conversation and the settings live in localStorage.
"use strict";

const STORE = "tokenmill.chat.v1";
const DEFAULTS = { system: "", temperature: 0.7, maxTokens: 512, apiKey: "" };

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), speed: $("speed"), messages: $("messages"), error: $("error"),
  form: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  newChat: $("new-chat"), toggleSettings: $("toggle-settings"), settings: $("settings"),
  system: $("system"), temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
};

const state = load();
let modelName = null;
let controller = null; // the AbortController of the answer being streamed

// An error the server answered with: its message is shown as it is.
class ServerError extends Error {}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    return {
      settings: { ...DEFAULTS, ...(saved.settings || {}) },
      messages: Array.isArray(saved.messages) ? saved.messages : [],
    };
  } catch {
    return { settings: { ...DEFAULTS }, messages: [] };
  }
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch {
    // storage full or disabled: the page still works, it just forgets on reload
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.settings.apiKey) h.Authorization = `Bearer ${state.settings.apiKey}`;
  return h;
}

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

const unreachable = () => `Cannot reach the server at ${location.origin}: is it running?`;

// A readable line for an HTTP error: the server's OpenAI error JSON if it sent one.
async function describe(response) {
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: keep the status text
  }
  if (response.status === 401) {
    return `${response.status}: ${message}. Enter the server's API key in Settings.`;
  }
  return `${response.status}: ${message}`;
}

async function loadModel() {
  ui.model.textContent = "…";
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      modelName = null;
      ui.model.textContent = "no model";
      showError(await describe(response));
      return;
    }
    const body = await response.json();
    modelName = body.data && body.data.length ? body.data[0].id : null;
    ui.model.textContent = modelName || "no model";
    clearError();
  } catch {
    modelName = null;
    ui.model.textContent = "offline";
    showError(unreachable());
  }
}

function bubble(message) {
  const node = document.createElement("div");
  node.className = `msg ${message.role}`;
  node.textContent = message.content; // text, never HTML
  if (message.stopped) {
    const note = document.createElement("span");
    note.className = "note";
    note.textContent = "stopped";
    node.append(note);
  }
  return node;
}

function render() {
  if (!state.messages.length) {
    const empty = document.createElement("p");
    empty.className = "empty";
    empty.textContent = "Ask something to start.";
    ui.messages.replaceChildren(empty);
    return;
  }
  ui.messages.replaceChildren(...state.messages.map(bubble));
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.newChat.disabled = busy;
}

// The `data:` payloads of a Server-Sent Events body, parsed, until `data: [DONE]`.
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function showSpeed(tokens, firstAt, endAt) {
  if (!tokens || firstAt === null) {
    ui.speed.textContent = "";
    return;
  }
  // Decode speed: the tokens after the first one, over the time since it came (the first one also waits for the prompt).
  const seconds = (endAt - firstAt) / 1000;
  const rate = tokens > 1 && seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–";
  ui.speed.textContent = `${tokens} tokens · ${rate} tok/s`;
}

async function ask(text) {
  clearError();
  state.messages.push({ role: "user", content: text });
  const answer = { role: "assistant", content: "" };
  state.messages.push(answer);
  save();
  render();
  const node = ui.messages.lastElementChild;
  node.classList.add("pending");

  const s = state.settings;
  const history = state.messages.slice(0, -1).map(({ role, content }) => ({ role, content }));
  const body = {
    messages: s.system ? [{ role: "system", content: s.system }, ...history] : history,
    stream: true,
    stream_options: { include_usage: true },
  };
  // An empty field leaves the server's default.
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.maxTokens !== "") body.max_tokens = Number(s.maxTokens);
  if (modelName) body.model = modelName;

  controller = new AbortController();
  setBusy(true);
  let chunks = 0;
  let usage = null;
  let firstAt = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new ServerError(await describe(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new ServerError(`${event.error.code}: ${event.error.message}`);
      if (event.usage && !(event.choices && event.choices.length)) usage = event.usage;
      const delta = event.choices && event.choices[0] && event.choices[0].delta.content;
      if (delta) {
        if (firstAt === null) firstAt = performance.now();
        chunks += 1;
        answer.content += delta;
        node.textContent = answer.content;
        ui.messages.scrollTop = ui.messages.scrollHeight;
      }
    }
  } catch (err) {
    if (err.name === "AbortError") {
      answer.stopped = true;
    } else {
      showError(err instanceof ServerError ? err.message : unreachable());
      if (!answer.content) {
        // Nothing came: take the question back out of the history and give it back to edit or resend.
        state.messages.splice(-2, 2);
        if (!ui.prompt.value) ui.prompt.value = text;
      }
    }
  } finally {
    controller = null;
    setBusy(false);
    // Without a usage chunk (stopped, failed), count content chunks: about one token each.
    showSpeed(usage ? usage.completion_tokens : chunks, firstAt, performance.now());
    save();
    render();
  }
}

function bindSettings() {
  const fields = [
    [ui.system, "system"], [ui.temperature, "temperature"], [ui.maxTokens, "maxTokens"], [ui.apiKey, "apiKey"],
  ];
  for (const [input, key] of fields) {
    input.value = state.settings[key];
    input.addEventListener("change", () => {
      state.settings[key] = input.type === "number" && input.value !== "" ? Number(input.value) : input.value;
      save();
      if (key === "apiKey") loadModel();
    });
  }
}

ui.form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || controller) return;
  ui.prompt.value = "";
  ask(text);
});

ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.form.requestSubmit();
  }
});

ui.stop.addEventListener("click", () => {
  if (controller) controller.abort();
});

ui.newChat.addEventListener("click", () => {
  state.messages = [];
  ui.speed.textContent = "";
  clearError();
  save();
  render();
});

ui.toggleSettings.addEventListener("click", () => {
  ui.settings.hidden = !ui.settings.hidden;
  ui.toggleSettings.setAttribute("aria-expanded", String(!ui.settings.hidden));
});

bindSettings();
render();
loadModel();

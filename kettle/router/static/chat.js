// The chat page: a conversation streamed through /v1/chat/completions (server-sent events).
//
// The model's text is untrusted: it is rendered as Markdown with raw HTML turned off (markdown-it escapes any tag
// the model writes), then sanitized by DOMPurify before it reaches the DOM, and the page's Content-Security-Policy
// forbids inline scripts on top. User text is only ever set as textContent.

import { authHeaders, setupKeyField, setupTheme, showModelInfo } from "./common.js";

const $ = (id) => document.getElementById(id);
const SETTINGS_KEY = "kettle.chat.settings";
const SETTING_FIELDS = ["system", "temperature", "top-p", "max-tokens", "seed", "stop-sequences", "schema", "adapter"];

const markdown = window.markdownit({ html: false, linkify: true, breaks: true });

// Links in answers open in a new tab and tell the target nothing about this page.
window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

/** Markdown → HTML that is safe to insert: markdown-it with raw HTML off, then DOMPurify. */
export function renderMarkdown(text) {
  return window.DOMPurify.sanitize(markdown.render(text), { USE_PROFILES: { html: true } });
}

// The conversation: {role: "user" | "assistant", text, element, stats?, error?}. Assistant turns that failed
// before any text stay on screen with their error but are not sent back to the model.
const turns = [];
let baseModel = "tgi";
let running = null; // {controller, turn} while an answer streams

const keyField = setupKeyField($("key-row"), $("api-key"));
setupTheme($("theme-toggle"));
restoreSettings();
showModelInfo();
loadModels();
if (matchMedia("(max-width: 760px)").matches) $("settings").removeAttribute("open");

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
$("prompt").addEventListener("keydown", (event) => {
  // Enter sends, Shift+Enter is a new line; never while an input method is composing a character.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && running) stop();
});
$("stop").addEventListener("click", stop);
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", clear);
for (const id of SETTING_FIELDS) $(id).addEventListener("change", saveSettings);

async function loadModels() {
  // /v1/models lists the base model first, then each LoRA adapter; `model` naming an adapter selects it.
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) return;
    const ids = (await response.json()).data.map((model) => model.id);
    baseModel = ids[0] || baseModel;
    const select = $("adapter");
    for (const id of ids.slice(1)) select.append(new Option(id, id));
    $("adapter-row").hidden = ids.length < 2;
    const saved = savedSettings().adapter;
    if (saved && ids.includes(saved)) select.value = saved;
  } catch {
    // The header already says the server is unreachable.
  }
}

function send() {
  const prompt = $("prompt");
  const text = prompt.value.trim();
  if (!text || running) return;
  prompt.value = "";
  addTurn({ role: "user", text });
  generate();
}

function regenerate() {
  if (running) return;
  // Drop the last answer (and any failed attempts after the last question), then ask again.
  while (turns.length && turns.at(-1).role === "assistant") removeTurn(turns.at(-1));
  if (turns.length) generate();
}

function clear() {
  if (running) stop();
  while (turns.length) removeTurn(turns.at(-1));
  $("status").textContent = "";
  updateButtons();
}

function stop() {
  if (running) running.controller.abort();
}

async function generate() {
  let body;
  try {
    body = requestBody();
  } catch (error) {
    const turn = addTurn({ role: "assistant", text: "" });
    fail(turn, error.message);
    updateButtons();
    return;
  }
  const turn = addTurn({ role: "assistant", text: "" });
  const controller = new AbortController();
  running = { controller, turn };
  turn.element.setAttribute("aria-busy", "true");
  $("status").textContent = "Generating…";
  updateButtons();
  const timing = { start: performance.now(), first: null, last: null, chunks: 0 };
  let finish = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream", ...authHeaders() },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw await httpError(response);
    for await (const event of serverSentEvents(response.body)) {
      if (event === "[DONE]") break;
      const chunk = JSON.parse(event);
      if (chunk.error) throw streamError(chunk.error);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const piece = choice.delta?.content || "";
      if (piece) {
        const now = performance.now();
        timing.first ??= now;
        timing.last = now;
        timing.chunks += 1;
        turn.text += piece;
        scheduleRender(turn);
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (!finish) throw new ChatError("The connection closed before the answer was complete. Regenerate to retry.");
  } catch (error) {
    if (error.name === "AbortError") finish = "stopped";
    else fail(turn, describe(error));
  } finally {
    running = null;
    turn.element.removeAttribute("aria-busy");
    renderTurn(turn);
    if (finish) {
      turn.stats = stats(timing, finish, usage);
      turn.element.querySelector(".stats").textContent = turn.stats;
      $("status").textContent = finish === "stopped" ? "Stopped." : "Done.";
    }
    updateButtons();
    // Back to the message box for the next question, unless a 401 just sent the focus to the key field.
    if (document.activeElement !== $("api-key")) $("prompt").focus();
  }
}

/** The chat request from the conversation and the settings; throws a ChatError for a setting that cannot be sent. */
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const turn of turns) {
    if (turn.text) messages.push({ role: turn.role, content: turn.text });
  }
  const body = {
    model: $("adapter").value || baseModel,
    messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  const number = (id) => ($(id).value.trim() === "" ? null : Number($(id).value));
  const temperature = number("temperature");
  if (temperature !== null) body.temperature = temperature;
  const topP = number("top-p");
  if (topP !== null) body.top_p = topP;
  const maxTokens = number("max-tokens");
  if (maxTokens !== null) body.max_tokens = maxTokens;
  const seed = number("seed");
  if (seed !== null) body.seed = seed;
  const stops = $("stop-sequences").value.split("\n").filter((line) => line !== "");
  if (stops.length) body.stop = stops;
  const schemaText = $("schema").value.trim();
  if (schemaText) {
    let schema;
    try {
      schema = JSON.parse(schemaText);
    } catch (error) {
      throw new ChatError(`The JSON schema is not valid JSON: ${error.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "schema", schema } };
  }
  return body;
}

/** Yields the data of each server-sent event of a streamed response body. */
async function* serverSentEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

class ChatError extends Error {
  constructor(message, status = null) {
    super(message);
    this.name = "ChatError";
    this.status = status;
  }
}

async function httpError(response) {
  let message = response.statusText;
  try {
    const body = await response.json();
    message = typeof body.error === "string" ? body.error : body.error?.message || body.detail || message;
  } catch {
    // Not JSON (a proxy's page): the status line says enough.
  }
  return new ChatError(message, response.status);
}

function streamError(error) {
  // TGI's shape {error, error_type} or OpenAI's {error: {message, http_status_code}}.
  if (typeof error === "string") return new ChatError(error);
  return new ChatError(error.message || JSON.stringify(error), error.http_status_code || null);
}

/** What a person needs to read for each failure. */
function describe(error) {
  if (!(error instanceof ChatError)) {
    // fetch rejects with a TypeError when the server cannot be reached or the connection drops mid-stream.
    return "Lost the connection to the server. Check that it is still running, then Regenerate.";
  }
  switch (error.status) {
    case 401:
      keyField.ask();
      return "This server needs an API key: enter it under Settings, then Regenerate.";
    case 429:
      return "The server is busy (it is answering as many requests as it allows). Retry in a moment with Regenerate.";
    case 413:
      return `The conversation is larger than the server accepts: ${error.message}. Clear it and start again.`;
    case 503:
      return `The server cannot take requests now: ${error.message}`;
    default:
      return error.message;
  }
}

function fail(turn, message) {
  turn.error = message;
  const box = document.createElement("div");
  box.className = "error";
  box.setAttribute("role", "alert");
  box.textContent = message;
  turn.element.querySelector(".meta").before(box);
  $("status").textContent = "Failed.";
}

function stats(timing, finish, usage) {
  const tokens = usage?.completion_tokens ?? timing.chunks;
  const parts = [];
  if (timing.first !== null) parts.push(`TTFT ${seconds(timing.first - timing.start)}`);
  // Decode speed: the tokens after the first over the time they took (the first one's wait is TTFT).
  if (tokens > 1 && timing.last > timing.first) {
    parts.push(`${((tokens - 1) / ((timing.last - timing.first) / 1000)).toFixed(1)} tok/s`);
  }
  parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  const reasons = { stop: "finished (stop)", length: "max tokens reached (length)", stopped: "stopped by you" };
  parts.push(reasons[finish] || finish);
  return parts.join(" · ");
}

function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function addTurn(turn) {
  $("empty").hidden = true;
  const item = document.createElement("li");
  item.className = `message ${turn.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = turn.role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  item.append(role, content);
  if (turn.role === "assistant") {
    const meta = document.createElement("div");
    meta.className = "meta";
    const statsLine = document.createElement("span");
    statsLine.className = "stats";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", "Copy this answer");
    copy.addEventListener("click", () => copyText(turn.text, copy));
    meta.append(statsLine, copy);
    item.append(meta);
  }
  turn.element = item;
  turns.push(turn);
  $("messages").append(item);
  renderTurn(turn);
  return turn;
}

function removeTurn(turn) {
  turn.element.remove();
  turns.splice(turns.indexOf(turn), 1);
  $("empty").hidden = turns.length > 0;
}

function renderTurn(turn) {
  const content = turn.element.querySelector(".content");
  if (turn.role === "user") content.textContent = turn.text;
  else content.innerHTML = renderMarkdown(turn.text);
  const list = $("messages");
  // Follow the answer as it grows, unless the reader has scrolled up to read something else.
  if (list.scrollHeight - list.scrollTop - list.clientHeight < 120) list.scrollTop = list.scrollHeight;
}

// Tokens can arrive faster than frames: render an answer at most once per frame.
const pending = new Set();
function scheduleRender(turn) {
  if (pending.size === 0) {
    requestAnimationFrame(() => {
      for (const waiting of pending) renderTurn(waiting);
      pending.clear();
    });
  }
  pending.add(turn);
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // The Clipboard API needs a secure context (https or localhost); elsewhere the old way still works.
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

function updateButtons() {
  const busy = running !== null;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !turns.some((turn) => turn.role === "user");
  $("clear").disabled = turns.length === 0;
}

function saveSettings() {
  const values = Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
}

function savedSettings() {
  try {
    return JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch {
    return {}; // written by another version of this page: start from the defaults
  }
}

function restoreSettings() {
  const saved = savedSettings();
  for (const id of SETTING_FIELDS) {
    if (id !== "adapter" && typeof saved[id] === "string") $(id).value = saved[id];
  }
}

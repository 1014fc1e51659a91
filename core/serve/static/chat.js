// bestiary's web chat: streams /v1/chat/completions (server-sent events), keeps the history,
// stops a request by aborting its fetch (the server cancels it and frees its KV blocks).
// A conversation longer than the engine's max_input_len loses its oldest turns (the server
// answers 400 context_length_exceeded; the request is sent again without them).
// Tokens/s = completion tokens / seconds from sending the request to its last token.
// Answers are Markdown, rendered by markdown.js (DOM nodes only: model output cannot inject HTML)
// while they stream (at most once a frame, at most 1/4 of the time); user messages stay plain text.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "api_key"];
const STORE = "bestiary-chat:";

const state = {
  history: [],       // [{role, content}] of this conversation (the system prompt is added per request)
  bubbles: [],       // the message element of each history entry
  conversation: 0,   // counts "New chat"s: a request of an earlier conversation leaves the history alone
  controller: null,  // AbortController of the request in flight
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function setStatus(text) {
  $("status").textContent = text;
}

// The {message, code} of an error answer (OpenAI's shape), or the HTTP status.
async function apiError(response) {
  try {
    const body = await response.json();
    if (body.error) return { message: body.error.message, code: body.error.code };
  } catch (_) { /* not JSON */ }
  return { message: `HTTP ${response.status}`, code: null };
}

async function errorText(response) {
  return (await apiError(response)).message;
}

// --- settings and models -------------------------------------------------------------

function loadSettings() {
  for (const id of SETTINGS) {
    const saved = localStorage.getItem(STORE + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => localStorage.setItem(STORE + id, $(id).value));
  }
}

async function loadModels() {
  const select = $("model");
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    if (response.status === 401) showSettings(true);
    setStatus(`models: ${await errorText(response)}`);
    return;
  }
  const { data } = await response.json();
  const wanted = localStorage.getItem(STORE + "model");
  select.replaceChildren(...data.map((card) => {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = card.parent ? `${card.id} (LoRA on ${card.parent})` : card.id;
    return option;
  }));
  if (data.some((card) => card.id === wanted)) select.value = wanted;
  setStatus("");
}

function showSettings(open) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
}

function number(id, parse) {
  const value = parse($(id).value);
  if (!Number.isFinite(value)) throw new Error(`${id}: expected a number`);
  return value;
}

// --- messages ------------------------------------------------------------------------

function addBubble(role, text) {
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  const body = document.createElement(role === "assistant" ? "div" : "span");
  body.className = role === "assistant" ? "text markdown" : "text";
  body.textContent = text;
  bubble.append(body);
  $("messages").append(bubble);
  bubble.scrollIntoView({ block: "end" });
  return bubble;
}

// Shows `answer` (Markdown) in `out`, whose data-source keeps the text as the model wrote it.
function showAnswer(out, answer) {
  out.dataset.source = answer;
  out.replaceChildren(renderMarkdown(answer));
}

// Calls render() once at an animation frame however often it is asked for meanwhile, and waits
// 3 times the last render's duration first: rendering a long answer takes at most 1/4 of the time.
function coalesced(render) {
  let pending = false;
  let cost = 0;  // ms the last render took
  return () => {
    if (pending) return;
    pending = true;
    setTimeout(() => requestAnimationFrame(() => {
      const start = performance.now();
      pending = false;
      render();
      cost = performance.now() - start;
    }), 3 * cost);
  };
}

function finishBubble(bubble, stateName, meta) {
  bubble.dataset.state = stateName;
  if (meta) {
    const line = document.createElement("span");
    line.className = "meta";
    line.textContent = meta;
    bubble.append(line);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("model").disabled = busy;
}

// --- one request ---------------------------------------------------------------------

function requestBody() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.history] : [...state.history];
  return {
    model: $("model").value,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature", parseFloat),
    top_p: number("top_p", parseFloat),
    max_tokens: number("max_tokens", (v) => parseInt(v, 10)),
  };
}

// The streaming response to the conversation, dropping its oldest turns while the server
// says it is too long; throws the server's error otherwise.
async function post(signal) {
  let dropped = 0;
  for (;;) {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal,
    });
    if (response.ok) return { response, dropped };
    const error = await apiError(response);
    if (error.code !== "context_length_exceeded" || state.history.length < 3) throw new Error(error.message);
    state.history.splice(0, 2);  // the oldest user message and its answer
    for (const bubble of state.bubbles.splice(0, 2)) bubble.classList.add("forgotten");
    dropped += 1;
  }
}

// Yields the parsed JSON of each "data:" event of a server-sent event stream until [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(text) {
  state.history.push({ role: "user", content: text });
  try {
    requestBody();  // a bad setting is said before anything is sent
  } catch (err) {
    state.history.pop();
    setStatus(err.message);
    return;
  }
  state.bubbles.push(addBubble("user", text));
  const bubble = addBubble("assistant", "");
  bubble.dataset.state = "streaming";
  const out = bubble.querySelector(".text");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  setStatus("waiting for the first token ...");
  const started = performance.now();
  let answer = "";
  let chunks = 0;
  let usage = null;
  let finish = null;
  let dropped = 0;
  const conversation = state.conversation;
  const scheduleRender = coalesced(() => {
    if (bubble.dataset.state !== "streaming") return;  // finished meanwhile: done, stopped or an error
    showAnswer(out, answer);
    bubble.scrollIntoView({ block: "end" });
  });
  const keep = (stateName, meta) => {
    if (conversation !== state.conversation) return;
    showAnswer(out, answer);
    state.history.push({ role: "assistant", content: answer });
    state.bubbles.push(bubble);
    const note = dropped ? ` (${dropped} oldest turn(s) dropped: the conversation exceeded max_input_len)` : "";
    finishBubble(bubble, stateName, meta + note);
    setStatus(meta + note);
  };
  try {
    const posted = await post(controller.signal);
    dropped = posted.dropped;
    setStatus("generating ...");
    for await (const chunk of events(posted.response)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        answer += choice.delta.content;
        chunks += 1;
        scheduleRender();
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : chunks;
    const rate = `${tokens} tokens, ${(tokens / seconds).toFixed(1)} tokens/s`;
    keep("done", finish === "length" ? `${rate} (max tokens reached)` : rate);
  } catch (err) {
    if (controller.signal.aborted) {  // the partial answer stays in the conversation
      const seconds = (performance.now() - started) / 1000;
      keep("stopped", `stopped after ~${chunks} tokens, ${(chunks / seconds).toFixed(1)} tokens/s`);
    } else if (conversation === state.conversation) {  // the user message failed: not part of the conversation
      state.history.pop();
      state.bubbles.pop().classList.add("forgotten");
      bubble.classList.add("error");
      delete out.dataset.source;
      out.textContent = err.message;
      finishBubble(bubble, "error", "");
      setStatus(`error: ${err.message}`);
    }
  } finally {
    state.controller = null;
    setBusy(false);
    $("input").focus();
  }
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.conversation += 1;
  state.history = [];
  state.bubbles = [];
  $("messages").replaceChildren();
  setStatus("");
}

// --- wiring --------------------------------------------------------------------------

function init() {
  loadSettings();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("settings-toggle").addEventListener("click", () => showSettings($("settings").hidden));
  $("model").addEventListener("change", () => localStorage.setItem(STORE + "model", $("model").value));
  $("api_key").addEventListener("change", loadModels);
  loadModels().catch((err) => setStatus(`models: ${err.message}`));
}

document.addEventListener("DOMContentLoaded", init);

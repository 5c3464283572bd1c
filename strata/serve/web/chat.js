// The chat page: conversations (store.js), streamed answers (api.js), markdown (render.js), each answer's figures.
import * as store from "./store.js";
import {AuthError, modelIds, streamChat} from "./api.js";
import {renderMarkdown} from "./render.js";

const $ = id => document.getElementById(id);
const state = store.loadState();
const settings = store.loadSettings();
let model = "default";
let modelKnown = false;      // model is the server's name for it (not the placeholder sent before it is known)
let running = null;               // {ctrl: AbortController, conv} while an answer streams
let keyWaiters = [];              // resolvers of askKey() calls waiting for a key

const RESUME_HELP = "Where the prompt's reading resumed: live (the conversation the engine holds), checkpoint " +
  "(a saved cut point), resident (a conversation parked on the device), park (one parked in host RAM), disk " +
  "(one parked on disk), session (a session file), none (read " +
  "from the start). cached: prompt tokens not read again; read: tokens read for this answer.";

function conversation() {
  return state.conversations.find(c => c.id === state.current) || store.newConversation(state);
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ---------------------------------------------------------------------------------------------- views
function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of state.conversations) {
    const li = el("li", c.id === state.current ? "current" : "");
    li.dataset.id = c.id;
    const open = el("button", "open", c.title || "New chat");
    open.type = "button";
    open.addEventListener("click", () => switchTo(c.id));
    const del = el("button", "delete", "×");
    del.type = "button";
    del.title = "Delete this conversation";
    del.setAttribute("aria-label", "Delete conversation");
    del.addEventListener("click", () => remove(c.id));
    li.append(open, del);
    ul.append(li);
  }
}

function fmtMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function fillMeta(meta, m) {
  meta.replaceChildren();
  const add = (cls, text, title) => {
    const s = el("span", cls, text);
    if (title) s.title = title;
    meta.append(s);
  };
  if (m.ttft_ms != null) add("ttft", `first token ${fmtMs(m.ttft_ms)}`, "time to first token, measured here");
  if (m.tps != null) add("tps", `${m.tps.toFixed(1)} tok/s`, "decode speed (timings.predicted_per_second)");
  if (m.predicted_n != null) add("tokens", `${m.predicted_n} tokens`);
  if (m.resume_from) {
    add(`resume resume-${m.resume_from}`, `prompt from ${m.resume_from}: ${m.cache_n ?? 0} cached, ` +
        `${m.prompt_n ?? "?"} read`, RESUME_HELP);
  }
  if (m.stopped) add("finish", "stopped");
  else if (m.finish_reason === "length") add("finish", "cut at max tokens");
  else if (m.finish_reason && m.finish_reason !== "stop") add("finish", m.finish_reason);
  meta.dataset.resumeFrom = m.resume_from || "";
  meta.dataset.cacheN = m.cache_n ?? "";
  meta.dataset.tps = m.tps ?? "";
  meta.dataset.ttftMs = m.ttft_ms ?? "";
  meta.dataset.finish = m.stopped ? "stopped" : (m.finish_reason || "");
}

// One message's element; .update() redraws it from `msg` (called while an answer streams).
function messageView(msg) {
  const article = el("article", `msg ${msg.role}`);
  article.dataset.role = msg.role;
  const reasoning = el("details", "reasoning");
  reasoning.append(el("summary", "", "Reasoning"), el("div", "text"));
  const body = el("div", "body");
  const error = el("p", "error");
  const meta = el("div", "meta");
  article.append(el("div", "who", msg.role === "user" ? "You" : "Assistant"), reasoning, body, error, meta);
  article.update = () => {
    if (msg.role === "assistant") renderMarkdown(body, msg.content);
    else body.textContent = msg.content;                  // what a user typed is text, never markup
    reasoning.hidden = !msg.reasoning;
    reasoning.querySelector(".text").textContent = msg.reasoning || "";
    error.hidden = !msg.error;
    error.textContent = msg.error || "";
    if (msg.role === "assistant") fillMeta(meta, msg.meta || {});
  };
  article.update();
  return article;
}

function renderConversation() {
  const box = $("messages");
  box.replaceChildren();
  const conv = conversation();
  if (!conv.messages.length) {
    const who = modelKnown ? model : "the model";
    box.append(el("p", "empty", `Ask ${who} something. Each answer shows its time to first token, its speed ` +
      "and where the prompt resumed from: a follow-up reads only what is new."));
  }
  for (const m of conv.messages) box.append(messageView(m));
  box.scrollTop = box.scrollHeight;
}

function renderButtons() {
  const busy = running !== null;
  document.body.dataset.state = busy ? "streaming" : "idle";
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("regenerate").disabled = busy || !conversation().messages.some(m => m.role === "user");
}

function renderAll() {
  renderList();
  renderConversation();
  renderButtons();
}

// ---------------------------------------------------------------------------------------------- the API key
// Ask for the key; resolves true once one is saved, false if the dialog is dismissed (Escape) without one.
function askKey(why) {
  $("key-error").textContent = why;
  $("key-input").value = "";
  const dlg = $("key-dialog");
  if (!dlg.open) dlg.showModal();
  $("key-input").focus();
  return new Promise(resolve => keyWaiters.push(resolve));
}

function keyGiven(ok) {
  const waiters = keyWaiters;
  keyWaiters = [];
  waiters.forEach(resolve => resolve(ok));
}

function saveKey(e) {
  e.preventDefault();
  const key = $("key-input").value.trim();
  if (!key) return;
  store.setKey(key);
  keyGiven(true);
  $("key-dialog").close();
}

function authMessage() {
  return store.getKey() ? "The server refused this key." : "";
}

async function loadModel() {
  for (;;) {
    try {
      const ids = await modelIds();
      model = ids[0] || "default";
      modelKnown = ids.length > 0;
      $("model").textContent = model;
      if (!conversation().messages.length) renderConversation();   // the empty state names the model
      return;
    } catch (e) {
      if (!(e instanceof AuthError)) {
        $("model").textContent = `(${e.message})`;
        return;
      }
      if (!await askKey(authMessage())) {
        $("model").textContent = "(no API key)";
        return;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- answers
function requestBody(conv) {
  const messages = conv.messages.filter(m => m.role === "user" || m.content)     // not a failed or empty answer
    .map(m => ({role: m.role, content: m.content}));
  if (settings.system.trim()) messages.unshift({role: "system", content: settings.system});
  const body = {model, messages};
  if (settings.max_tokens != null) body.max_tokens = settings.max_tokens;
  if (settings.temperature != null) body.temperature = settings.temperature;
  return body;
}

// Stream the assistant's answer to the conversation as it stands; a 401 asks for the key and tries again.
async function answer(conv) {
  const msg = {role: "assistant", content: "", reasoning: "", meta: {}};
  const view = messageView(msg);
  const shown = () => conv.id === state.current;
  if (shown()) {
    const box = $("messages");
    box.querySelector(".empty")?.remove();
    box.append(view);
    box.scrollTop = box.scrollHeight;      // the question was just sent: the answer starts in view
  }
  const ctrl = new AbortController();
  running = {ctrl, conv};
  renderButtons();
  let frame = 0;
  const redraw = () => {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      const box = $("messages");
      const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      view.update();
      if (atEnd) box.scrollTop = box.scrollHeight;
    });
  };
  const t0 = performance.now();
  let retry = false;
  try {
    for await (const chunk of streamChat(requestBody(conv), ctrl.signal)) {
      for (const choice of chunk.choices || []) {
        const d = choice.delta || {};
        if (d.content || d.reasoning_content) {
          msg.meta.ttft_ms ??= performance.now() - t0;
          msg.content += d.content || "";
          msg.reasoning += d.reasoning_content || "";
          redraw();
        }
        if (choice.finish_reason) msg.meta.finish_reason = choice.finish_reason;
      }
      if (chunk.timings) {
        msg.meta.tps = chunk.timings.predicted_per_second ?? null;
        msg.meta.predicted_n = chunk.timings.predicted_n ?? null;
        msg.meta.prompt_n = chunk.timings.prompt_n ?? null;
        msg.meta.cache_n = chunk.timings.cache_n ?? 0;
      }
      if (chunk.strata) {
        msg.meta.resume_from = chunk.strata.resume_from || null;
        msg.meta.resume_pos = chunk.strata.resume_pos ?? null;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.meta.stopped = true;
    else if (e instanceof AuthError && !msg.content) retry = true;
    else msg.error = e.message || String(e);
  } finally {
    if (frame) cancelAnimationFrame(frame);
    running = null;
  }
  if (retry) {
    view.remove();
    renderButtons();
    if (await askKey(authMessage())) return answer(conv);
    msg.error = "The server asks for an API key (Settings: API key…), then Regenerate.";
    if (shown()) $("messages").append(view);
  }
  conv.messages.push(msg);
  store.saveState(state);
  const box = $("messages");          // the last chunks were not drawn yet: stay at the end if the reader was there
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  view.update();
  renderButtons();
  if (atEnd && shown()) box.scrollTop = box.scrollHeight;
}

function send(e) {
  e.preventDefault();
  const text = $("input").value;
  if (running || !text.trim()) return;
  const conv = conversation();
  conv.messages.push({role: "user", content: text});
  if (!conv.title) conv.title = text.trim().replace(/\s+/g, " ").slice(0, 60);
  store.saveState(state);
  $("input").value = "";
  renderAll();
  answer(conv);
}

function regenerate() {
  if (running) return;
  const conv = conversation();
  while (conv.messages.length && conv.messages.at(-1).role === "assistant") conv.messages.pop();
  if (!conv.messages.length) return;
  store.saveState(state);
  renderAll();
  answer(conv);
}

function stop() {
  if (running) running.ctrl.abort();
}

// ---------------------------------------------------------------------------------------------- conversations
function switchTo(id) {
  if (id === state.current) return;
  stop();                          // the answer streaming now ends where it is, kept in its own conversation
  state.current = id;
  store.saveState(state);
  renderAll();
}

function newChat() {
  stop();
  const empty = state.conversations.find(c => !c.messages.length);
  if (empty) state.current = empty.id;
  else store.newConversation(state);
  store.saveState(state);
  renderAll();
  $("input").focus();
}

function remove(id) {
  if (running && running.conv.id === id) stop();
  state.conversations = state.conversations.filter(c => c.id !== id);
  if (state.current === id) state.current = state.conversations[0]?.id ?? null;
  conversation();
  store.saveState(state);
  renderAll();
}

// ---------------------------------------------------------------------------------------------- settings
function bindSettings() {
  const sys = $("set-system"), max = $("set-max-tokens"), temp = $("set-temperature");
  sys.value = settings.system;
  max.value = settings.max_tokens ?? "";
  temp.value = settings.temperature ?? "";
  const num = (input, parse) => {
    const v = input.value.trim() === "" ? null : parse(input.value);
    return v == null || Number.isFinite(v) ? v : null;
  };
  const save = () => {
    settings.system = sys.value;
    settings.max_tokens = num(max, v => parseInt(v, 10));
    settings.temperature = num(temp, parseFloat);
    store.saveSettings(settings);
  };
  for (const input of [sys, max, temp]) input.addEventListener("change", save);
  $("change-key").addEventListener("click", () => askKey("").then(ok => ok && loadModel()));
}

function init() {
  conversation();
  bindSettings();
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("new-chat").addEventListener("click", newChat);
  $("key-form").addEventListener("submit", saveKey);
  $("key-dialog").addEventListener("close", () => keyGiven(false));   // dismissed: the requests waiting give up
  renderAll();
  loadModel().then(() => {
    document.body.dataset.ready = "1";
    if (!conversation().messages.length) renderConversation();
  });
}

init();

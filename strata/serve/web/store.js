// Conversations, settings and the API key, kept in the browser's localStorage (the daemon stores none of them).
const CONVERSATIONS = "strata.conversations.v1";
const SETTINGS = "strata.settings.v1";
const API_KEY = "strata.apiKey";

function read(key) {
  try {
    return JSON.parse(localStorage.getItem(key));
  } catch {
    return null;
  }
}

function isMessage(m) {
  return m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
}

// {conversations: [{id, title, messages: [{role, content, reasoning?, meta?, error?}]}], current: id}
export function loadState() {
  const s = read(CONVERSATIONS) || {};
  const conversations = (Array.isArray(s.conversations) ? s.conversations : [])
    .filter(c => c && typeof c.id === "string" && Array.isArray(c.messages))
    .map(c => ({id: c.id, title: String(c.title || ""), messages: c.messages.filter(isMessage)}));
  const current = conversations.some(c => c.id === s.current) ? s.current : null;
  return {conversations, current};
}

export function saveState(state) {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(state));
}

export function newConversation(state) {
  const c = {id: crypto.randomUUID ? crypto.randomUUID() : String(Date.now()) + Math.random(), title: "", messages: []};
  state.conversations.unshift(c);
  state.current = c.id;
  return c;
}

// max_tokens / temperature: a number, or null to leave it to the server.
export function loadSettings() {
  const s = read(SETTINGS) || {};
  const num = v => (typeof v === "number" && Number.isFinite(v) ? v : null);
  return {system: typeof s.system === "string" ? s.system : "", max_tokens: num(s.max_tokens),
          temperature: num(s.temperature)};
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS, JSON.stringify(settings));
}

export function getKey() {
  return localStorage.getItem(API_KEY) || "";
}

export function setKey(key) {
  localStorage.setItem(API_KEY, key);
}

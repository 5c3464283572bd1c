// The page's requests to the daemon's OpenAI-compatible API: the API key header, error objects, streaming chat.
import {getKey} from "./store.js";
import {sseEvents} from "./sse.js";

export class ApiError extends Error {}
export class AuthError extends ApiError {}      // 401: no key, or the key was refused

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = getKey();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function check(resp) {
  if (resp.ok) return resp;
  let message = `HTTP ${resp.status}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch { /* not JSON: keep the status */ }
  throw new (resp.status === 401 ? AuthError : ApiError)(message);
}

// The served models' ids (GET /v1/models).
export async function modelIds() {
  const resp = await check(await fetch("v1/models", {headers: headers()}));
  return (await resp.json()).data.map(m => m.id);
}

// POST /v1/chat/completions with stream: true; yields the chunks (an in-stream error object is thrown).
export async function* streamChat(body, signal) {
  const resp = await check(await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify({...body, stream: true}), signal}));
  for await (const chunk of sseEvents(resp)) {
    if (chunk.error) throw new ApiError(chunk.error.message || "the server failed mid-answer");
    yield chunk;
  }
}

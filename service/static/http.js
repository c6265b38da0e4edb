// HTTP: the page is a client of the API like any other; every number it shows comes back from
// these calls. Errors become Problems (errors.js).

import { Problem } from "./errors.js";
import { $ } from "./format.js";

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

export async function postJson(path, body) {
  const headers = {
    "Content-Type": "application/json",
    Accept: "application/json, application/problem+json",
    ...authHeaders(),
  };
  let response;
  try {
    response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body) });
  } catch (e) {
    throw new Problem({ title: "Network error", detail: `could not reach the service: ${e.message}` });
  }
  const text = await response.text();
  let payload = null;
  try {
    payload = JSON.parse(text);
  } catch {
    payload = null;
  }
  if (!response.ok) {
    if (payload && typeof payload === "object" && ("title" in payload || "detail" in payload)) {
      throw new Problem({
        title: payload.title ?? `HTTP ${response.status}`,
        status: payload.status ?? response.status,
        detail: typeof payload.detail === "string" ? payload.detail : JSON.stringify(payload.detail),
        errors: Array.isArray(payload.errors) ? payload.errors : [],
      });
    }
    throw new Problem({
      title: response.statusText || `HTTP ${response.status}`,
      status: response.status,
      detail: text.slice(0, 400),
    });
  }
  if (payload === null) {
    throw new Problem({ title: "Bad response", status: response.status, detail: "the service did not answer JSON" });
  }
  return payload;
}

// GET /v1/info. A 401 opens the API key field rather than failing every run silently.
export async function loadServerInfo() {
  const box = $("server-info");
  try {
    const response = await fetch("/v1/info", { headers: { Accept: "application/json", ...authHeaders() } });
    if (response.status === 401) {
      document.querySelector("details.apikey").open = true;
      throw new Error("API key required");
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const info = await response.json();
    if (info.auth) document.querySelector("details.apikey").open = true;
    const parts = [];
    if (info.version) parts.push(`v${info.version}`);
    if (info.device) parts.push(`device ${typeof info.device === "string" ? info.device : JSON.stringify(info.device)}`);
    if (info.torch_version || info.torch) parts.push(`torch ${info.torch_version ?? info.torch}`);
    box.textContent = parts.length ? parts.join(" · ") : "service up";
  } catch (e) {
    box.textContent = `service info unavailable (${e.message})`;
    box.classList.add("bad");
  }
}

// A static asset of the page (the default capture), as bytes.
export async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Problem({ title: "Missing asset", status: response.status, detail: `GET ${url}` });
  return response.arrayBuffer();
}

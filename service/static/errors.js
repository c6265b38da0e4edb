// Errors: problem+json from the API, and the same shape for mistakes caught in the page, so
// both are shown by one panel.

import { CaptureError } from "./capture.js";
import { $, el } from "./format.js";
import { NpyError } from "./npy.js";

export class Problem extends Error {
  constructor({ title, status = null, detail = "", errors = [] }) {
    super(detail || title);
    this.title = title;
    this.status = status;
    this.detail = detail;
    this.errors = errors;
  }
}

export function formError(loc, msg) {
  return new Problem({ title: "Invalid input", detail: msg, errors: [{ loc, msg }] });
}

export function toProblem(e) {
  if (e instanceof Problem) return e;
  if (e instanceof NpyError) return new Problem({ title: "Unreadable .npy file", detail: e.message });
  if (e instanceof CaptureError) return new Problem({ title: "Unreadable capture", detail: e.message });
  console.error(e);
  return new Problem({ title: "Page error", detail: String(e && e.message ? e.message : e) });
}

// Fills `container` with the problem; with the named parts given, fills those instead (the
// main error panel has fixed ids the tests read).
export function renderProblem(container, problem, { titleEl, statusEl, detailEl, listEl } = {}) {
  const title = titleEl ?? el("strong");
  const status = statusEl ?? el("span", { class: "badge" });
  const detail = detailEl ?? el("p");
  const list = listEl ?? el("ul");
  title.textContent = problem.title || "Error";
  status.textContent = problem.status ? String(problem.status) : "";
  detail.textContent = problem.detail || "";
  list.replaceChildren(
    ...(problem.errors || []).map((e) => {
      const loc = Array.isArray(e.loc) ? e.loc.join(" → ") : String(e.loc ?? "");
      return el("li", {}, el("span", { class: "loc", text: loc }), document.createTextNode(e.msg ?? ""));
    }),
  );
  if (!titleEl) {
    container.replaceChildren(el("div", { class: "problem-head" }, status, title), detail, list);
  }
  container.hidden = false;
}

export function showError(problem) {
  renderProblem($("error"), problem, {
    titleEl: $("error-title"),
    statusEl: $("error-status"),
    detailEl: $("error-detail"),
    listEl: $("error-list"),
  });
}

export function clearError() {
  $("error").hidden = true;
  document.querySelector("main").classList.remove("stale");
}

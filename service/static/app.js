// The explorer page: reads the form, builds Q/K/V, calls POST /v1/attention (weights + full
// diagnostics) and POST /v1/analyze, and draws the results.
//
// For tests and scripting, window.__explorer exposes the state of the last run:
//   state ("idle" | "running" | "done" | "error"), runCount, lastRequest, lastResponse,
//   lastAnalyzeRequest, lastAnalyze, lastError, analyzeError, maskCheck,
//   masked(head, row, col, batch = 0) -> bool, weightAt(head, row, col, batch = 0) -> number,
//   heatmap (the drawn head: geometry in device pixels, and expectedRgb(row, col), the colour
//   its visible cells are drawn in), palette, isMaskedRgb(r, g, b), run() -> Promise,
//   selectHead(h), parseNpy(ArrayBuffer).

import {
  PALETTE,
  drawBars,
  drawColorbar,
  drawHeatmap,
  drawRowChart,
  drawThumbnail,
  isMaskedRgb,
  linearIndex,
  logIndex,
  lutColor,
} from "./draw.js";
import { maskModel } from "./masks.js";
import { NpyError, parseNpy } from "./npy.js";
import { syntheticQKV } from "./prng.js";
import { decodeWireTensor, encodeTensor, nest, product, toFlat } from "./tensor.js";

const $ = (id) => document.getElementById(id);

const SUMMARY_FIELDS = [
  ["entropy", "entropy", "mean row entropy of the weights, in nats"],
  ["normalized_entropy", "normalized entropy", "entropy / ln(visible keys), in [0, 1]"],
  ["effective_keys", "effective keys", "exp(entropy): how many keys a row spreads over"],
  ["max_weight", "max weight", "mean of each row's largest weight"],
  ["saturated_fraction", "saturated fraction", "share of rows whose max weight ≥ 0.99"],
  ["sink_share", "sink share", "mean share of a row's weight on its first keys (the server's SDPA_HEALTH_SINK_TOKENS)"],
  ["score_mean_raw", "score mean (raw)", "mean of q·k over visible entries"],
  ["score_variance_raw", "score variance (raw)", "variance of q·k over visible entries"],
  ["score_variance_scaled", "score variance (scaled)", "variance of s·q·k: ≈ 1 is the aim"],
  ["score_abs_max_scaled", "|score| max (scaled)", "largest |s·q·k| over visible entries"],
  ["grad_health", "grad health", "mean p(1−p): the softmax Jacobian's diagonal; → 0 when saturated"],
  ["jacobian_fro", "Jacobian ‖·‖F", "row mean of ‖diag(p) − ppᵀ‖F"],
  ["masked_rows", "masked rows", "rows with no visible key (output 0)"],
];

const ROW_METRICS = {
  entropy: { title: "entropy per row (nats)", bound: "entropy" },
  normalized_entropy: { title: "normalized entropy per row", bound: null },
  max_weight: { title: "max weight per row", bound: null },
  effective_keys: { title: "effective keys per row", bound: "keys" },
  sink_share: { title: "sink share per row (weight on the first keys)", bound: null },
};

// ---------------------------------------------------------------------------------------------
// State exposed to tests.

const view = {
  head: 0,
  batch: 0,
  result: null, // decoded attention result, see decodeResult()
  analyze: null,
  geometry: null,
};

const explorer = {
  state: "idle",
  runCount: 0,
  lastRequest: null,
  lastResponse: null,
  lastAnalyzeRequest: null,
  lastAnalyze: null,
  lastError: null,
  analyzeError: null,
  maskCheck: null,
  timings: null,
  heatmap: null,
  palette: PALETTE,
  isMaskedRgb,
  parseNpy,
  masked(head, row, col, batch = 0) {
    const r = view.result;
    if (!r) throw new Error("no result yet");
    return r.mask.masked(batch * r.heads + head, row, col);
  },
  weightAt(head, row, col, batch = 0) {
    const r = view.result;
    if (!r) throw new Error("no result yet");
    return r.weights[((batch * r.heads + head) * r.nQ + row) * r.nKv + col];
  },
  run: () => run(),
  selectHead: (h) => selectHead(h),
};
window.__explorer = explorer;

// ---------------------------------------------------------------------------------------------
// Formatting.

function fmt(x, { integer = false } = {}) {
  if (x === null || x === undefined) return "–";
  if (x === -Infinity) return "−∞";
  if (x === Infinity) return "∞";
  if (Number.isNaN(x)) return "NaN";
  if (integer) return String(Math.round(x));
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(3);
  return x.toPrecision(5);
}

function fmtShort(x) {
  if (!Number.isFinite(x)) return fmt(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-2 || a >= 1e4)) return x.toExponential(1);
  return String(Number(x.toPrecision(3)));
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

// ---------------------------------------------------------------------------------------------
// Errors: problem+json from the API, and the same shape for mistakes caught in the page.

class Problem extends Error {
  constructor({ title, status = null, detail = "", errors = [] }) {
    super(detail || title);
    this.title = title;
    this.status = status;
    this.detail = detail;
    this.errors = errors;
  }
}

function formError(loc, msg) {
  return new Problem({ title: "Invalid input", detail: msg, errors: [{ loc, msg }] });
}

function renderProblem(container, problem, { titleEl, statusEl, detailEl, listEl } = {}) {
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

function showError(problem) {
  renderProblem($("error"), problem, {
    titleEl: $("error-title"),
    statusEl: $("error-status"),
    detailEl: $("error-detail"),
    listEl: $("error-list"),
  });
}

function clearError() {
  $("error").hidden = true;
  document.querySelector("main").classList.remove("stale");
}

// ---------------------------------------------------------------------------------------------
// HTTP.

async function postJson(path, body) {
  const headers = {
    "Content-Type": "application/json",
    Accept: "application/json, application/problem+json",
  };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
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

// ---------------------------------------------------------------------------------------------
// Inputs.

// Parsed uploads, and why a chosen file could not be used (shown next to it and on Run).
const uploads = { npy: { q: null, k: null, v: null }, npyErrors: {}, json: null, jsonError: null };

function intField(id, { min, max }) {
  const raw = $(id).value.trim();
  const n = Number(raw);
  if (raw === "" || !Number.isInteger(n) || n < min || n > max) {
    throw formError(["form", id], `must be an integer in [${min}, ${max}], got ${JSON.stringify(raw)}`);
  }
  return n;
}

function numberField(id, { positive = false } = {}) {
  const raw = $(id).value.trim();
  const n = Number(raw);
  if (raw === "" || !Number.isFinite(n) || (positive && !(n > 0))) {
    throw formError(["form", id], `must be a ${positive ? "positive " : ""}number, got ${JSON.stringify(raw)}`);
  }
  return n;
}

function source() {
  return document.querySelector('input[name="source"]:checked').value;
}

function readInputs() {
  const kind = source();
  if (kind === "synthetic") {
    const heads = intField("heads", { min: 1, max: 64 });
    const nQ = intField("n-q", { min: 1, max: 4096 });
    const nKv = intField("n-kv", { min: 1, max: 4096 });
    const dK = intField("d-k", { min: 1, max: 4096 });
    const std = numberField("std", { positive: true });
    const seed = intField("seed", { min: 0, max: 2 ** 32 - 1 });
    // Keep the browser responsive: weights of more than 2^24 cells would not be drawable anyway.
    if (heads * nQ * nKv > 2 ** 24) {
      throw formError(["form", "n-q"], `heads × N_q × N_kv = ${heads * nQ * nKv} is more than 2^24 weights`);
    }
    return syntheticQKV({ heads, nQ, nKv, dK, dV: dK, std, seed });
  }
  if (kind === "npy") {
    for (const name of ["q", "k", "v"]) {
      if (uploads.npyErrors[name]) throw formError(["form", `npy-${name}`], uploads.npyErrors[name]);
      if (!uploads.npy[name]) throw formError(["form", `npy-${name}`], `choose a .npy file for ${name.toUpperCase()}`);
    }
    return { ...uploads.npy };
  }
  if (uploads.jsonError) throw formError(["form", "json-file"], uploads.jsonError);
  if (!uploads.json) throw formError(["form", "json-file"], "choose a JSON file with q, k and v");
  return { ...uploads.json };
}

// "48" -> one length per sequence; "48, 32, 16, 64" -> one per head (when that count matches);
// "[[...]]" -> sent as written.
function readKeyLengths(qShape) {
  const raw = $("key-lengths").value.trim();
  if (raw === "") return null;
  if (raw.startsWith("[")) {
    try {
      return JSON.parse(raw);
    } catch (e) {
      throw formError(["form", "key-lengths"], `not valid JSON: ${e.message}`);
    }
  }
  const parts = raw.split(/[\s,;]+/).filter((s) => s.length > 0);
  const flat = parts.map((s) => {
    const n = Number(s);
    if (!Number.isInteger(n)) throw formError(["form", "key-lengths"], `${JSON.stringify(s)} is not an integer`);
    return n;
  });
  const rank = qShape.length;
  const batchShape = rank >= 3 ? qShape.slice(0, rank - 3) : [];
  const heads = rank >= 3 ? qShape[rank - 3] : 1;
  const batches = product(batchShape);
  if (flat.length === batches && batchShape.length > 0) return nest(flat, batchShape);
  if (flat.length === batches * heads && rank >= 3) return nest(flat, [...batchShape, heads]);
  if (flat.length === 1 && rank >= 3) {
    return nest(new Array(batches * heads).fill(flat[0]), [...batchShape, heads]);
  }
  return flat.length === 1 ? flat[0] : flat;
}

function readScale(dK) {
  const mode = $("scale-mode").value;
  if (mode === "sqrt_dk") return { mode, scale: null, effective: 1 / Math.sqrt(dK) };
  if (mode === "none") return { mode, scale: 1.0, effective: 1.0 };
  if (mode === "dk") return { mode, scale: 1 / dK, effective: 1 / dK };
  const s = numberField("scale-custom");
  return { mode, scale: s, effective: s };
}

function readCausal() {
  const v = $("causal").value;
  return v === "none" ? false : v;
}

// ---------------------------------------------------------------------------------------------
// Results.

function decodeResult(request, response, tensors) {
  const weights = decodeWireTensor(response.weights, "weights");
  const shape = weights.shape;
  const nQ = shape[shape.length - 2];
  const nKv = shape[shape.length - 1];
  const mask = maskModel({
    qShape: tensors.q.shape,
    kShape: tensors.k.shape,
    causal: request.causal,
    keyLengths: request.key_lengths,
  });
  const heads = mask.heads;
  const batches = mask.batches;
  const diagnostics = response.diagnostics ?? {};
  const perRow = {};
  for (const [k, v] of Object.entries(diagnostics.per_row ?? {})) perRow[k] = toFlat(v);
  const perHead = {};
  for (const [k, v] of Object.entries(diagnostics.per_head ?? {})) perHead[k] = toFlat(v);
  return {
    weights: weights.values,
    weightsShape: shape,
    nQ,
    nKv,
    heads,
    batches,
    batchShape: mask.batchShape,
    mask,
    summary: diagnostics.summary ?? {},
    perHead,
    perRow,
    meta: response.meta ?? {},
  };
}

// The client's mask must agree with the service: per-row visible key counts, and weight 0 in
// every masked cell. A disagreement is reported on the page, never papered over.
function checkMask(r) {
  let rows = 0;
  let countMismatches = 0;
  let nonzeroMasked = 0;
  const visible = r.perRow.visible_keys;
  for (let s = 0; s < r.batches * r.heads; s++) {
    for (let i = 0; i < r.nQ; i++) {
      rows++;
      if (visible && visible[s * r.nQ + i] !== r.mask.visibleCount(s, i)) countMismatches++;
      const base = (s * r.nQ + i) * r.nKv;
      for (let j = 0; j < r.nKv; j++) {
        if (r.weights[base + j] !== 0 && r.mask.masked(s, i, j)) nonzeroMasked++;
      }
    }
  }
  return { rows, countMismatches, nonzeroMasked, agree: countMismatches === 0 && nonzeroMasked === 0 };
}

function sliceIndex() {
  return view.batch * view.result.heads + view.head;
}

function headWeights(r, slice) {
  const n = r.nQ * r.nKv;
  return r.weights.subarray(slice * n, (slice + 1) * n);
}

// The colour scale of one head: shade(i, w) -> LUT index, plus the legend's end labels.
// "robust" (the default) clips at the 99th percentile of the visible weights, so a few rows
// that see one key (weight 1, e.g. the first causal rows) do not wash out the rest.
function shaderFor(r, slice) {
  const mode = $("color-range").value;
  const w = headWeights(r, slice);
  if (mode === "unit") return { shade: (_i, x) => linearIndex(x, 1), lo: "0", hi: "1" };
  if (mode === "row") {
    const rowMax = new Float64Array(r.nQ);
    for (let i = 0; i < r.nQ; i++) {
      for (let j = 0; j < r.nKv; j++) rowMax[i] = Math.max(rowMax[i], w[i * r.nKv + j]);
    }
    return { shade: (i, x) => linearIndex(x, rowMax[i]), lo: "0", hi: "row max" };
  }
  const visible = [];
  for (let i = 0; i < r.nQ; i++) {
    for (let j = 0; j < r.nKv; j++) if (!r.mask.masked(slice, i, j)) visible.push(w[i * r.nKv + j]);
  }
  const sorted = Float64Array.from(visible).sort();
  const max = sorted.length ? sorted[sorted.length - 1] : 0;
  if (mode === "log") {
    const hi = max > 0 ? max : 1;
    const lo = hi / 1000;
    return { shade: (_i, x) => logIndex(x, lo, hi), lo: fmtShort(lo), hi: fmtShort(hi) };
  }
  let vmax = max;
  if (mode === "robust" && sorted.length) vmax = sorted[Math.floor(0.99 * (sorted.length - 1))];
  if (!(vmax > 0)) vmax = max > 0 ? max : 1;
  const hi = mode === "robust" && vmax < max ? `${fmtShort(vmax)}+` : fmtShort(vmax);
  return { shade: (_i, x) => linearIndex(x, vmax), lo: "0", hi };
}

function renderHeatmap() {
  const r = view.result;
  if (!r) return;
  const slice = sliceIndex();
  const shader = shaderFor(r, slice);
  const weights = headWeights(r, slice);
  const geometry = drawHeatmap($("heatmap"), {
    weights,
    nQ: r.nQ,
    nKv: r.nKv,
    masked: (i, j) => r.mask.masked(slice, i, j),
    shade: shader.shade,
    hatch: $("hatch").checked,
  });
  const overlay = $("heatmap-overlay");
  overlay.width = $("heatmap").width;
  overlay.height = $("heatmap").height;
  overlay.style.width = $("heatmap").style.width;
  overlay.style.height = $("heatmap").style.height;
  view.geometry = geometry;
  explorer.heatmap = {
    ...geometry,
    head: view.head,
    batch: view.batch,
    canvasId: "heatmap",
    expectedRgb: (i, j) =>
      r.mask.masked(slice, i, j) ? null : lutColor(shader.shade(i, weights[i * r.nKv + j])),
  };

  drawColorbar($("colorbar"), {});
  $("vmin-label").textContent = shader.lo;
  $("vmax-label").textContent = shader.hi;
  renderRowChart();
  for (const thumb of $("thumbs").children) {
    thumb.setAttribute("aria-pressed", String(Number(thumb.dataset.head) === view.head));
  }
}

function renderRowChart() {
  const r = view.result;
  if (!r || !view.geometry) return;
  const metric = $("row-metric").value;
  const spec = ROW_METRICS[metric];
  $("row-chart-title").textContent = spec.title;
  const slice = sliceIndex();
  const series = r.perRow[metric];
  if (!series) return;
  const values = series.subarray(slice * r.nQ, (slice + 1) * r.nQ);
  const counts = Array.from({ length: r.nQ }, (_, i) => r.mask.visibleCount(slice, i));
  const empty = counts.map((c) => c === 0);
  let reference = null;
  let xmax = 1;
  if (spec.bound === "entropy") {
    reference = counts.map((c) => (c > 0 ? Math.log(c) : 0));
    xmax = Math.log(Math.max(2, r.nKv));
  } else if (spec.bound === "keys") {
    reference = counts;
    xmax = r.nKv;
  }
  $("reference-legend").hidden = reference === null;
  drawRowChart($("row-chart"), {
    values,
    reference,
    empty,
    nQ: r.nQ,
    cssCell: view.geometry.cssCell,
    xmax,
    format: fmtShort,
  });
}

function renderThumbs() {
  const r = view.result;
  const box = $("thumbs");
  box.replaceChildren();
  if (r.heads < 2 || r.heads > 32) return;
  for (let h = 0; h < r.heads; h++) {
    const slice = view.batch * r.heads + h;
    const canvas = el("canvas");
    const button = el("button", { type: "button", class: "thumb", "data-head": String(h) }, canvas, `head ${h}`);
    button.addEventListener("click", () => selectHead(h));
    drawThumbnail(canvas, {
      weights: headWeights(r, slice),
      nQ: r.nQ,
      nKv: r.nKv,
      masked: (i, j) => r.mask.masked(slice, i, j),
      shade: shaderFor(r, slice).shade,
    });
    box.append(button);
  }
}

function selectHead(h) {
  view.head = h;
  $("head-select").value = String(h);
  renderHeatmap();
  renderSummary();
}

function renderSelectors() {
  const r = view.result;
  const heads = $("head-select");
  heads.replaceChildren(...Array.from({ length: r.heads }, (_, h) => el("option", { value: String(h), text: String(h) })));
  view.head = Math.min(view.head, r.heads - 1);
  heads.value = String(view.head);
  const batch = $("batch-select");
  $("batch-select-label").hidden = r.batches < 2;
  batch.replaceChildren(
    ...Array.from({ length: r.batches }, (_, b) => el("option", { value: String(b), text: String(b) })),
  );
  view.batch = Math.min(view.batch, r.batches - 1);
  batch.value = String(view.batch);
}

function renderSummary() {
  const r = view.result;
  if (!r) return;
  const table = $("summary-table");
  const showHeads = r.heads <= 12;
  const heads = showHeads ? Array.from({ length: r.heads }, (_, h) => h) : [view.head];
  const headRow = el(
    "tr",
    {},
    el("th", { text: "statistic" }),
    el("th", { text: r.batches > 1 ? "all sequences" : "all heads" }),
    ...heads.map((h) => el("th", { text: `head ${h}`, class: h === view.head ? "sel" : "" })),
  );
  const rows = SUMMARY_FIELDS.map(([field, label, help]) => {
    const integer = field === "masked_rows";
    const value = r.summary[field];
    const cells = [
      el("td", { class: "field", title: help }, label, el("small", { text: help })),
      el("td", {
        "data-field": field,
        "data-scope": "summary",
        "data-value": value === null || value === undefined ? "" : String(value),
        text: fmt(value, { integer }),
      }),
    ];
    const perHead = r.perHead[field];
    for (const h of heads) {
      const v = perHead ? perHead[view.batch * r.heads + h] : undefined;
      cells.push(
        el("td", {
          "data-field": field,
          "data-scope": "head",
          "data-head": String(h),
          "data-value": v === undefined ? "" : String(v),
          text: fmt(v, { integer }),
        }),
      );
    }
    return el("tr", {}, ...cells);
  });
  table.replaceChildren(el("thead", {}, headRow), el("tbody", {}, ...rows));
}

function renderMeta(roundTripMs) {
  const m = view.result.meta;
  const parts = [];
  if (m.path) parts.push(`path ${m.path}`);
  if (m.device) parts.push(m.device);
  if (m.dtype) parts.push(m.dtype);
  if (m.batch_size !== undefined) parts.push(`batch ${m.batch_size}`);
  if (m.queue_ms !== undefined) parts.push(`queue ${fmtShort(m.queue_ms)} ms`);
  if (m.compute_ms !== undefined) parts.push(`compute ${fmtShort(m.compute_ms)} ms`);
  parts.push(`round trip ${Math.round(roundTripMs)} ms`);
  $("meta").textContent = parts.join(" · ");
  $("meta").title = m.request_id ? `request id ${m.request_id}` : "";
}

function renderMaskCheck() {
  const c = explorer.maskCheck;
  const node = $("mask-check");
  if (c.agree) {
    node.textContent = `Mask check: the page's mask matches the service's visible keys on all ${c.rows} rows.`;
    node.classList.remove("bad");
  } else {
    node.textContent =
      `Mask check FAILED: ${c.countMismatches} rows disagree with the service's visible_keys, ` +
      `${c.nonzeroMasked} masked cells carry a nonzero weight.`;
    node.classList.add("bad");
  }
}

function strategyNameForScale(mode) {
  return mode === "custom" ? "custom" : mode;
}

function renderAnalyze(report, scaleMode, nKv) {
  const strategies = report.strategies ?? [];
  const current = strategyNameForScale(scaleMode);
  const rows = (field) =>
    strategies.map((s) => ({ label: s.name, value: s[field], highlight: s.name === current }));
  const variances = strategies.map((s) => s.score_variance).filter((v) => v > 0);
  let lo = variances.length ? 10 ** Math.floor(Math.log10(Math.min(...variances, 1))) : 1e-2;
  let hi = variances.length ? 10 ** Math.ceil(Math.log10(Math.max(...variances, 1))) : 1e2;
  if (hi / lo < 100) {
    lo /= 10;
    hi *= 10;
  }
  drawBars($("bars-variance"), {
    rows: rows("score_variance"),
    scale: "log",
    domain: [lo, hi],
    refLine: { value: 1 },
    format: fmtShort,
  });
  const entropyMax = Math.max(Math.log(Math.max(2, nKv)), ...strategies.map((s) => s.entropy));
  drawBars($("bars-entropy"), {
    rows: rows("entropy"),
    domain: [0, entropyMax],
    refLine: { value: Math.log(Math.max(2, nKv)) },
    format: fmtShort,
  });
  drawBars($("bars-max-weight"), { rows: rows("max_weight"), domain: [0, 1], format: fmtShort });

  const cols = [
    ["divisor", "divisor"],
    ["score_variance", "score var"],
    ["entropy", "entropy"],
    ["normalized_entropy", "norm. entropy"],
    ["max_weight", "max weight"],
    ["saturated_fraction", "saturated"],
    ["grad_health", "grad health"],
  ];
  $("scaling-table").replaceChildren(
    el("thead", {}, el("tr", {}, el("th", { text: "strategy" }), ...cols.map(([, t]) => el("th", { text: t })))),
    el(
      "tbody",
      {},
      ...strategies.map((s) =>
        el(
          "tr",
          { class: s.name === current ? "current" : "", "data-strategy": s.name },
          el("td", { text: s.name }),
          ...cols.map(([f]) =>
            el("td", { "data-field": f, "data-value": String(s[f]), text: fmt(s[f]) }),
          ),
        ),
      ),
    ),
  );
  $("scaling-note").textContent =
    `d_k = ${report.d_k} · raw score variance ${fmt(report.raw_score_variance)} · ` +
    `recommended divisor ${fmt(report.recommended_divisor)} = std of the raw scores ` +
    `(√d_k = ${fmt(Math.sqrt(report.d_k))}). Dashed lines: variance 1, uniform entropy ln N_kv.`;
}

// ---------------------------------------------------------------------------------------------
// A run.

let running = null;

async function run() {
  if (running) return running;
  running = doRun().finally(() => {
    running = null;
  });
  return running;
}

async function doRun() {
  explorer.state = "running";
  $("run").disabled = true;
  const status = $("status");
  status.classList.remove("bad");
  status.textContent = "running…";
  const started = performance.now();
  try {
    const tensors = readInputs();
    const dK = tensors.q.shape[tensors.q.shape.length - 1];
    const { mode, scale, effective } = readScale(dK);
    const causal = readCausal();
    const keyLengths = readKeyLengths(tensors.q.shape);
    const encoding = $("encoding").value;
    const wire = {
      q: encodeTensor(tensors.q, encoding),
      k: encodeTensor(tensors.k, encoding),
      v: encodeTensor(tensors.v, encoding),
    };
    const request = {
      ...wire,
      causal,
      key_lengths: keyLengths,
      scale,
      return_weights: true,
      diagnostics: "full",
      response_encoding: encoding,
    };
    const analyzeRequest = { q: wire.q, k: wire.k, causal, key_lengths: keyLengths };
    if (mode === "custom" && effective > 0) {
      // The analysis speaks in divisors of the raw scores; the attention call in multipliers.
      analyzeRequest.strategies = [
        "none",
        "sqrt_dk",
        "dk",
        "dk_quarter",
        "two_sqrt_dk",
        { name: "custom", divisor: 1 / effective },
      ];
    }
    explorer.lastRequest = request;
    explorer.lastAnalyzeRequest = analyzeRequest;

    const [attention, analysis] = await Promise.allSettled([
      postJson("/v1/attention", request),
      postJson("/v1/analyze", analyzeRequest),
    ]);
    const roundTrip = performance.now() - started;
    const renderStart = performance.now();

    if (analysis.status === "fulfilled") {
      explorer.lastAnalyze = analysis.value;
      explorer.analyzeError = null;
      $("analyze-error").hidden = true;
    } else {
      explorer.lastAnalyze = null;
      explorer.analyzeError = analysis.reason;
      renderProblem($("analyze-error"), toProblem(analysis.reason));
    }

    if (attention.status === "rejected") throw attention.reason;
    explorer.lastResponse = attention.value;
    view.result = decodeResult(request, attention.value, tensors);
    const decoded = performance.now();
    explorer.maskCheck = checkMask(view.result);
    clearError();
    renderSelectors();
    renderThumbs();
    renderHeatmap();
    renderSummary();
    renderMeta(roundTrip);
    renderMaskCheck();
    if (explorer.lastAnalyze) renderAnalyze(explorer.lastAnalyze, mode, view.result.nKv);
    explorer.timings = {
      requestMs: roundTrip,
      decodeMs: decoded - renderStart,
      renderMs: performance.now() - decoded,
    };
    explorer.lastError = null;
    explorer.state = "done";
    status.textContent = `done in ${Math.round(performance.now() - started)} ms`;
  } catch (e) {
    const problem = toProblem(e);
    explorer.lastError = { title: problem.title, status: problem.status, detail: problem.detail, errors: problem.errors };
    explorer.state = "error";
    showError(problem);
    $("error-stale").hidden = view.result === null;
    document.querySelector("main").classList.toggle("stale", view.result !== null);
    status.textContent = problem.status ? `failed (${problem.status})` : "failed";
    status.classList.add("bad");
  } finally {
    explorer.runCount += 1;
    $("run").disabled = false;
  }
}

function toProblem(e) {
  if (e instanceof Problem) return e;
  if (e instanceof NpyError) return new Problem({ title: "Unreadable .npy file", detail: e.message });
  console.error(e);
  return new Problem({ title: "Page error", detail: String(e && e.message ? e.message : e) });
}

// ---------------------------------------------------------------------------------------------
// Wiring.

function describe(t) {
  return `${t.dtype} [${t.shape.join(", ")}]`;
}

async function readFile(input) {
  const file = input.files && input.files[0];
  if (!file) return null;
  return { name: file.name, buffer: await file.arrayBuffer() };
}

function wireUploads() {
  for (const name of ["q", "k", "v"]) {
    const input = $(`npy-${name}`);
    const info = $(`npy-${name}-info`);
    input.addEventListener("change", async () => {
      uploads.npy[name] = null;
      uploads.npyErrors[name] = null;
      info.classList.remove("bad");
      const file = await readFile(input);
      if (!file) {
        info.textContent = "no file";
        return;
      }
      try {
        uploads.npy[name] = parseNpy(file.buffer, file.name);
        info.textContent = describe(uploads.npy[name]);
      } catch (e) {
        uploads.npyErrors[name] = e.message;
        info.textContent = e.message;
        info.classList.add("bad");
      }
    });
  }
  const jsonInput = $("json-file");
  const jsonInfo = $("json-info");
  jsonInput.addEventListener("change", async () => {
    uploads.json = null;
    uploads.jsonError = null;
    jsonInfo.classList.remove("bad");
    const file = await readFile(jsonInput);
    if (!file) {
      jsonInfo.textContent = "no file";
      return;
    }
    try {
      const doc = JSON.parse(new TextDecoder().decode(file.buffer));
      const tensors = {};
      for (const name of ["q", "k", "v"]) {
        if (!(name in doc)) throw new Error(`the file has no "${name}"`);
        tensors[name] = decodeWireTensor(doc[name], name);
      }
      uploads.json = tensors;
      jsonInfo.textContent = ["q", "k", "v"].map((n) => `${n}: ${describe(tensors[n])}`).join(" · ");
    } catch (e) {
      uploads.jsonError = `${file.name}: ${e.message}`;
      jsonInfo.textContent = e.message;
      jsonInfo.classList.add("bad");
    }
  });
}

function wireControls() {
  const panels = { synthetic: $("panel-synthetic"), npy: $("panel-npy"), json: $("panel-json") };
  for (const radio of document.querySelectorAll('input[name="source"]')) {
    radio.addEventListener("change", () => {
      for (const [k, p] of Object.entries(panels)) p.hidden = k !== source();
    });
  }
  $("scale-mode").addEventListener("change", () => {
    $("scale-custom-row").hidden = $("scale-mode").value !== "custom";
  });
  $("controls").addEventListener("submit", (event) => {
    event.preventDefault();
    run();
  });
  $("head-select").addEventListener("change", () => selectHead(Number($("head-select").value)));
  $("batch-select").addEventListener("change", () => {
    view.batch = Number($("batch-select").value);
    renderThumbs();
    renderHeatmap();
    renderSummary();
  });
  $("row-metric").addEventListener("change", renderRowChart);
  $("color-range").addEventListener("change", () => {
    if (view.result) {
      renderThumbs();
      renderHeatmap();
    }
  });
  $("hatch").addEventListener("change", renderHeatmap);
  wireHover();
}

function wireHover() {
  const canvas = $("heatmap");
  const overlay = $("heatmap-overlay");
  const readout = $("readout");
  canvas.addEventListener("mouseleave", () => {
    overlay.getContext("2d").clearRect(0, 0, overlay.width, overlay.height);
  });
  canvas.addEventListener("mousemove", (event) => {
    const r = view.result;
    const g = view.geometry;
    if (!r || !g) return;
    const rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left - g.cssLeft;
    const y = event.clientY - rect.top - g.cssTop;
    const j = Math.floor(x / g.cssCell);
    const i = Math.floor(y / g.cssCell);
    const ctx = overlay.getContext("2d");
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, overlay.width, overlay.height);
    if (i < 0 || j < 0 || i >= r.nQ || j >= r.nKv) return;
    const slice = sliceIndex();
    const w = r.weights[(slice * r.nQ + i) * r.nKv + j];
    const masked = r.mask.masked(slice, i, j);
    const rowIdx = slice * r.nQ + i;
    const ent = r.perRow.entropy ? r.perRow.entropy[rowIdx] : undefined;
    const vis = r.mask.visibleCount(slice, i);
    readout.textContent =
      `query ${i} · key ${j} · ` +
      (masked ? "masked" : `weight ${fmt(w)}`) +
      ` · row: ${vis} visible keys, entropy ${fmt(ent)} nats`;
    ctx.strokeStyle = "#ffffff";
    ctx.lineWidth = Math.max(1, g.dpr);
    const cx = g.x0 + j * g.cell;
    const cy = g.y0 + i * g.cell;
    ctx.strokeRect(g.x0 + 0.5, cy + 0.5, r.nKv * g.cell - 1, g.cell - 1);
    ctx.strokeStyle = "#e8590c";
    ctx.strokeRect(cx - 1.5, cy - 1.5, g.cell + 3, g.cell + 3);
  });
}

async function loadServerInfo() {
  const box = $("server-info");
  try {
    const headers = { Accept: "application/json" };
    const key = $("api-key").value.trim();
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch("/v1/info", { headers });
    if (response.status === 401) {
      // The service wants a key: open the field rather than fail every run silently.
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

wireUploads();
wireControls();
loadServerInfo();
run();

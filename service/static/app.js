// The explorer page's entry point: one state object, the event wiring, and the start-up
// (open the committed capture of a real sentence, then run it). The jobs live in modules:
//   format.js  numbers and DOM nodes        errors.js  problem+json and the error panel
//   http.js    calls to the API             form.js    the controls -> tensors and fields
//   capture.js .npz captures (sdpa-tap)     render.js  heatmap, charts, tables
//   run.js     one run and the per-head analysis; draw.js, masks.js, tensor.js, npy.js, prng.js
//
// For tests and scripting, window.__explorer exposes the state of the last run:
//   state ("idle" | "running" | "done" | "error"), runCount, lastRequest, lastResponse,
//   lastAnalyzeRequest, lastAnalyze, lastError, analyzeError, maskCheck,
//   analyzeState / analyzeScope (a capture's per-head analysis: "running" | "done" | "error",
//   and the {layer, head, batch} it was for), capture (the parsed capture, or null),
//   masked(head, row, col, batch = 0) -> bool, weightAt(head, row, col, batch = 0) -> number,
//   heatmap (the drawn head: geometry in device pixels, the axis labels drawn, and
//   expectedRgb(row, col), the colour its visible cells are drawn in), palette,
//   isMaskedRgb(r, g, b), run() -> Promise, selectHead(h), selectLayer(l) -> Promise,
//   openCapture(ArrayBuffer, name) -> Promise, parseNpy(ArrayBuffer), parseCapture(ArrayBuffer).

import { CaptureError, DEFAULT_CAPTURE_URL, parseCapture } from "./capture.js";
import { PALETTE, isMaskedRgb } from "./draw.js";
import { toProblem } from "./errors.js";
import { $, describeTensor, fmt } from "./format.js";
import { applyCaptureSettings, setSource, showPanel, source } from "./form.js";
import { fetchBytes, loadServerInfo } from "./http.js";
import { parseNpy } from "./npy.js";
import { renderHeatmap, renderRowChart, renderSummary, renderThumbs, sliceIndex } from "./render.js";
import { analyzeHead, run } from "./run.js";
import { decodeWireTensor } from "./tensor.js";

// What the diagnostics table and the per-row chart show, in order: [field, label, help] and
// field -> {title, bound}. Kept here, in the file tests/service/test_field_lists.py reads, which
// holds both lists to sdpa_core's field lists; render.js gets them through the state.
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

function createState() {
  const state = {
    view: { head: 0, batch: 0, layer: 0, result: null, geometry: null, scaleMode: null, strategies: null },
    // Parsed uploads, and why a chosen file could not be used (shown next to it and on Run).
    uploads: { npy: { q: null, k: null, v: null }, npyErrors: {}, json: null, jsonError: null },
    capture: { data: null, error: null },
    running: null,
    analyzeTicket: 0,
    explorer: null,
    fields: { summary: SUMMARY_FIELDS, rowMetrics: ROW_METRICS },
    selectHead: (h) => selectHead(state, h),
  };
  state.explorer = {
    state: "idle",
    runCount: 0,
    lastRequest: null,
    lastResponse: null,
    lastAnalyzeRequest: null,
    lastAnalyze: null,
    lastError: null,
    analyzeError: null,
    analyzeState: "idle",
    analyzeScope: null,
    maskCheck: null,
    timings: null,
    heatmap: null,
    palette: PALETTE,
    isMaskedRgb,
    parseNpy,
    parseCapture,
    get capture() {
      return state.capture.data;
    },
    masked(head, row, col, batch = 0) {
      const r = state.view.result;
      if (!r) throw new Error("no result yet");
      return r.mask.masked(batch * r.heads + head, row, col);
    },
    weightAt(head, row, col, batch = 0) {
      const r = state.view.result;
      if (!r) throw new Error("no result yet");
      return r.weights[((batch * r.heads + head) * r.nQ + row) * r.nKv + col];
    },
    run: () => run(state),
    selectHead: (h) => selectHead(state, h),
    selectLayer: (l) => selectLayer(state, l),
    openCapture: (buffer, name) => openCapture(state, buffer, name),
  };
  return state;
}

function selectHead(state, h) {
  state.view.head = h;
  $("head-select").value = String(h);
  renderHeatmap(state);
  renderSummary(state);
  return analyzeHead(state);
}

function selectLayer(state, layer) {
  state.view.layer = layer;
  return run(state);
}

// A capture replaces the sentence on screen: its tokens, its mask and scale in the form, and
// a run of its first layer.
async function openCapture(state, buffer, name) {
  const info = $("capture-info");
  info.classList.remove("bad");
  state.capture.error = null;
  try {
    const capture = await parseCapture(buffer, name);
    state.capture.data = capture;
    state.view.layer = capture.layers[0].layer;
    state.view.batch = 0;
    applyCaptureSettings(capture);
    const first = capture.layers[0];
    const [B, H, N, D] = first.q.shape;
    info.textContent =
      `${name}: ${capture.layers.length} layers × ${H} heads, ${B > 1 ? `${B} sequences of ` : ""}` +
      `${N} tokens, d_k = ${D}`;
    $("capture-text").textContent = capture.tokens[0].join(" ");
  } catch (e) {
    state.capture.data = null;
    state.capture.error = e instanceof CaptureError ? e.message : `${name}: ${toProblem(e).detail}`;
    info.textContent = state.capture.error;
    info.classList.add("bad");
  }
  setSource("capture");
  return run(state);
}

async function readFile(input) {
  const file = input.files && input.files[0];
  if (!file) return null;
  return { name: file.name, buffer: await file.arrayBuffer() };
}

function wireUploads(state) {
  const { uploads } = state;
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
        info.textContent = describeTensor(uploads.npy[name]);
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
      jsonInfo.textContent = ["q", "k", "v"].map((n) => `${n}: ${describeTensor(tensors[n])}`).join(" · ");
    } catch (e) {
      uploads.jsonError = `${file.name}: ${e.message}`;
      jsonInfo.textContent = e.message;
      jsonInfo.classList.add("bad");
    }
  });
  const captureInput = $("capture-file");
  captureInput.addEventListener("change", async () => {
    const file = await readFile(captureInput);
    if (file) await openCapture(state, file.buffer, file.name);
  });
}

function wireControls(state) {
  const { view } = state;
  for (const radio of document.querySelectorAll('input[name="source"]')) {
    radio.addEventListener("change", () => showPanel(source()));
  }
  $("scale-mode").addEventListener("change", () => {
    $("scale-custom-row").hidden = $("scale-mode").value !== "custom";
  });
  $("controls").addEventListener("submit", (event) => {
    event.preventDefault();
    run(state);
  });
  $("head-select").addEventListener("change", () => selectHead(state, Number($("head-select").value)));
  $("layer-select").addEventListener("change", () => selectLayer(state, Number($("layer-select").value)));
  $("batch-select").addEventListener("change", () => {
    view.batch = Number($("batch-select").value);
    renderThumbs(state, (h) => selectHead(state, h));
    renderHeatmap(state);
    renderSummary(state);
    analyzeHead(state);
  });
  $("row-metric").addEventListener("change", () => renderRowChart(state));
  $("color-range").addEventListener("change", () => {
    if (view.result) {
      renderThumbs(state, (h) => selectHead(state, h));
      renderHeatmap(state);
    }
  });
  $("hatch").addEventListener("change", () => renderHeatmap(state));
  wireHover(state);
}

function wireHover(state) {
  const canvas = $("heatmap");
  const overlay = $("heatmap-overlay");
  const readout = $("readout");
  canvas.addEventListener("mouseleave", () => {
    overlay.getContext("2d").clearRect(0, 0, overlay.width, overlay.height);
  });
  canvas.addEventListener("mousemove", (event) => {
    const r = state.view.result;
    const g = state.view.geometry;
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
    const slice = sliceIndex(state);
    const w = r.weights[(slice * r.nQ + i) * r.nKv + j];
    const masked = r.mask.masked(slice, i, j);
    const ent = r.perRow.entropy ? r.perRow.entropy[slice * r.nQ + i] : undefined;
    const vis = r.mask.visibleCount(slice, i);
    const tokens = r.tokens ? r.tokens[state.view.batch] : null;
    const name = (index) => (tokens ? ` "${tokens[index]}"` : "");
    readout.textContent =
      `query ${i}${name(i)} · key ${j}${name(j)} · ` +
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

// The page opens on the committed capture of a real sentence; if it cannot be read (an
// installation without it), random inputs are the fallback, with the reason next to the input.
async function start(state) {
  window.__explorer = state.explorer;
  wireUploads(state);
  wireControls(state);
  loadServerInfo();
  try {
    const buffer = await fetchBytes(DEFAULT_CAPTURE_URL);
    await openCapture(state, buffer, DEFAULT_CAPTURE_URL.split("/").pop());
  } catch (e) {
    $("capture-info").textContent = `the default capture could not be loaded: ${toProblem(e).detail}`;
    $("capture-info").classList.add("bad");
    setSource("synthetic");
    await run(state);
  }
}

start(createState());

// Rendering: decodes the service's answer and draws it (heatmap, per-row chart, head
// thumbnails, the diagnostics table, the scaling comparison). Every function takes the page's
// one state object; what the tests read is written to state.explorer (window.__explorer).

import {
  drawBars,
  drawColorbar,
  drawHeatmap,
  drawRowChart,
  drawThumbnail,
  linearIndex,
  logIndex,
  lutColor,
} from "./draw.js";
import { $, el, fmt, fmtShort } from "./format.js";
import { maskModel } from "./masks.js";
import { decodeWireTensor, toFlat } from "./tensor.js";

// The API's answer -> flat arrays the drawing code indexes directly. `inputs.tokens` (a
// capture's, one list per sequence) label the axes.
export function decodeResult(request, response, inputs) {
  const weights = decodeWireTensor(response.weights, "weights");
  const shape = weights.shape;
  const mask = maskModel({
    qShape: inputs.q.shape,
    kShape: inputs.k.shape,
    causal: request.causal,
    keyLengths: request.key_lengths,
  });
  const diagnostics = response.diagnostics ?? {};
  const perRow = {};
  for (const [k, v] of Object.entries(diagnostics.per_row ?? {})) perRow[k] = toFlat(v);
  const perHead = {};
  for (const [k, v] of Object.entries(diagnostics.per_head ?? {})) perHead[k] = toFlat(v);
  return {
    weights: weights.values,
    weightsShape: shape,
    nQ: shape[shape.length - 2],
    nKv: shape[shape.length - 1],
    heads: mask.heads,
    batches: mask.batches,
    batchShape: mask.batchShape,
    mask,
    summary: diagnostics.summary ?? {},
    perHead,
    perRow,
    meta: response.meta ?? {},
    tokens: inputs.tokens ?? null,
    layer: inputs.layer ?? null,
    // The run's own q and k, for the per-head analysis of a capture.
    q: inputs.q,
    k: inputs.k,
  };
}

// The client's mask must agree with the service: per-row visible key counts, and weight 0 in
// every masked cell. A disagreement is reported on the page, never papered over.
export function checkMask(r) {
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

export function sliceIndex(state) {
  return state.view.batch * state.view.result.heads + state.view.head;
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

// A capture's tokens label both axes when queries and keys are the same sequence.
function labelsFor(state) {
  const r = state.view.result;
  const tokens = r.tokens ? r.tokens[state.view.batch] : null;
  if (!tokens || tokens.length !== r.nQ || tokens.length !== r.nKv) return null;
  return { rows: tokens, cols: tokens };
}

export function renderHeatmap(state) {
  const { view, explorer } = state;
  const r = view.result;
  if (!r) return;
  const slice = sliceIndex(state);
  const shader = shaderFor(r, slice);
  const weights = headWeights(r, slice);
  const geometry = drawHeatmap($("heatmap"), {
    weights,
    nQ: r.nQ,
    nKv: r.nKv,
    masked: (i, j) => r.mask.masked(slice, i, j),
    shade: shader.shade,
    hatch: $("hatch").checked,
    labels: labelsFor(state),
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
    layer: r.layer,
    canvasId: "heatmap",
    expectedRgb: (i, j) =>
      r.mask.masked(slice, i, j) ? null : lutColor(shader.shade(i, weights[i * r.nKv + j])),
  };

  drawColorbar($("colorbar"), {});
  $("vmin-label").textContent = shader.lo;
  $("vmax-label").textContent = shader.hi;
  renderRowChart(state);
  for (const thumb of $("thumbs").children) {
    thumb.setAttribute("aria-pressed", String(Number(thumb.dataset.head) === view.head));
  }
}

export function renderRowChart(state) {
  const { view } = state;
  const ROW_METRICS = state.fields.rowMetrics;
  const r = view.result;
  if (!r || !view.geometry) return;
  const metric = $("row-metric").value;
  const spec = ROW_METRICS[metric];
  $("row-chart-title").textContent = spec.title;
  const slice = sliceIndex(state);
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
    top: view.geometry.cssTop,
    xmax,
    format: fmtShort,
  });
}

export function renderThumbs(state, onSelect) {
  const { view } = state;
  const r = view.result;
  const box = $("thumbs");
  box.replaceChildren();
  if (r.heads < 2 || r.heads > 32) return;
  for (let h = 0; h < r.heads; h++) {
    const slice = view.batch * r.heads + h;
    const canvas = el("canvas");
    const button = el("button", { type: "button", class: "thumb", "data-head": String(h) }, canvas, `head ${h}`);
    button.addEventListener("click", () => onSelect(h));
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

export function renderSelectors(state) {
  const { view } = state;
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
  // The layer selector belongs to a capture's result: a layer is a different q, k, v.
  const capture = r.layer === null ? null : state.capture.data;
  $("layer-select-label").hidden = capture === null;
  if (capture) {
    $("layer-select").replaceChildren(
      ...capture.layers.map((l) => el("option", { value: String(l.layer), text: String(l.layer) })),
    );
    $("layer-select").value = String(r.layer);
  }
}

export function renderSummary(state) {
  const { view } = state;
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
  const rows = state.fields.summary.map(([field, label, help]) => {
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

export function renderMeta(state, roundTripMs) {
  const m = state.view.result.meta;
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

export function renderMaskCheck(state) {
  const c = state.explorer.maskCheck;
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

// `scope` is null (the analysis covers every head of the request) or {layer, head} (one head
// of a capture: the seeds' experiment on the model's own q and k).
export function renderAnalyze(report, scaleMode, nKv, scope = null) {
  const strategies = report.strategies ?? [];
  const current = scaleMode;
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
          ...cols.map(([f]) => el("td", { "data-field": f, "data-value": String(s[f]), text: fmt(s[f]) })),
        ),
      ),
    ),
  );
  $("scaling-scope").textContent = scope
    ? `layer ${scope.layer} · head ${scope.head}: this head's own q and k`
    : "/v1/analyze on the same Q, K and mask: the raw scores divided by each divisor";
  const dK = report.d_k;
  const variance = report.raw_score_variance;
  const lead = scope
    ? `The raw scores q·k of this head have variance ${fmt(variance)} against d_k = ${dK} ` +
      `(${fmt(variance / dK)} × d_k; unit-variance, independent q and k would give exactly d_k). `
    : `d_k = ${dK} · raw score variance ${fmt(variance)} · `;
  $("scaling-note").textContent =
    lead +
    `Recommended divisor ${fmt(report.recommended_divisor)} = std of the raw scores ` +
    `(√d_k = ${fmt(Math.sqrt(dK))}). Dashed lines: variance 1, uniform entropy ln N_kv.`;
}

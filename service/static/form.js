// The form: reads the controls into tensors and request fields, and writes a capture's own
// settings (mask, scale) back into them, so the form stays the one source of a run's request.

import { formError } from "./errors.js";
import { $ } from "./format.js";
import { syntheticQKV } from "./prng.js";
import { nest, product } from "./tensor.js";

// "capture" (a real model's sentence) | "synthetic" (random) | "npy" | "json".
export function source() {
  return document.querySelector('input[name="source"]:checked').value;
}

export function setSource(kind) {
  $(`source-${kind}`).checked = true;
  showPanel(kind);
}

export function showPanel(kind) {
  for (const panel of document.querySelectorAll(".source-panel")) {
    panel.hidden = panel.id !== `panel-${kind}`;
  }
}

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

// -> {q, k, v, tokens?, layer?}: page tensors, and for a capture the tokens of each sequence.
export function readInputs(state) {
  const kind = source();
  const { uploads } = state;
  if (kind === "capture") {
    const capture = state.capture.data;
    if (state.capture.error) throw formError(["form", "capture-file"], state.capture.error);
    if (!capture) throw formError(["form", "capture-file"], "the capture is still loading");
    const layer = capture.layers.find((l) => l.layer === state.view.layer) ?? capture.layers[0];
    return { q: layer.q, k: layer.k, v: layer.v, tokens: capture.tokens, layer: layer.layer };
  }
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
export function readKeyLengths(qShape) {
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

export function readScale(dK) {
  const mode = $("scale-mode").value;
  if (mode === "sqrt_dk") return { mode, scale: null, effective: 1 / Math.sqrt(dK) };
  if (mode === "none") return { mode, scale: 1.0, effective: 1.0 };
  if (mode === "dk") return { mode, scale: 1 / dK, effective: 1 / dK };
  const s = numberField("scale-custom");
  return { mode, scale: s, effective: s };
}

export function readCausal() {
  const v = $("causal").value;
  return v === "none" ? false : v;
}

// A capture's mask and scale, as the model's kernel had them, written into the form: BERT-like
// encoders see every real token (no causal mask), padding hidden by key lengths.
export function applyCaptureSettings(capture) {
  const first = capture.layers[0];
  $("causal").value = first.causal ? "top_left" : "none";
  const n = first.q.shape[2];
  $("key-lengths").value = capture.lengths.every((l) => l === n) ? "" : capture.lengths.join(", ");
  const dK = first.q.shape[3];
  if (first.scale === null || Math.abs(first.scale * Math.sqrt(dK) - 1) < 1e-6) {
    $("scale-mode").value = "sqrt_dk";
  } else {
    $("scale-mode").value = "custom";
    $("scale-custom").value = String(first.scale);
  }
  $("scale-custom-row").hidden = $("scale-mode").value !== "custom";
}

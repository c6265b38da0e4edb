// A run: the form -> POST /v1/attention (weights + full diagnostics) and POST /v1/analyze ->
// the drawings. The page computes no attention itself; it only draws what the API answered.

import { clearError, renderProblem, showError, toProblem } from "./errors.js";
import { $ } from "./format.js";
import { readCausal, readInputs, readKeyLengths, readScale } from "./form.js";
import { postJson } from "./http.js";
import {
  checkMask,
  decodeResult,
  renderAnalyze,
  renderHeatmap,
  renderMaskCheck,
  renderMeta,
  renderSelectors,
  renderSummary,
  renderThumbs,
} from "./render.js";
import { encodeTensor } from "./tensor.js";

const DEFAULT_STRATEGIES = ["none", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk"];

// The analysis speaks in divisors of the raw scores; the attention call in multipliers.
function strategiesFor(mode, effective) {
  if (mode === "custom" && effective > 0) return [...DEFAULT_STRATEGIES, { name: "custom", divisor: 1 / effective }];
  return null;
}

// One head [b, h] of a [B, H, N, D] page tensor, as a [1, 1, N, D] one.
function headOf(t, b, h) {
  const [B, H, N, D] = t.shape;
  if (b >= B || h >= H) throw new Error(`head ${h} of sequence ${b} is outside [${t.shape}]`);
  const n = N * D;
  const start = (b * H + h) * n;
  const out = { dtype: t.dtype, shape: [1, 1, N, D], values: t.values.slice(start, start + n) };
  if (t.bits) out.bits = t.bits.slice(start, start + n);
  return out;
}

// The key lengths of one head, shaped for a [1, 1, N, D] request.
function keyLengthsOfHead(keyLengths, b, h) {
  if (keyLengths === null || typeof keyLengths === "number") return keyLengths;
  let x = keyLengths[b];
  if (Array.isArray(x)) x = x[h];
  return [[x]];
}

export function run(state) {
  if (state.running) return state.running;
  state.running = doRun(state).finally(() => {
    state.running = null;
  });
  return state.running;
}

async function doRun(state) {
  const { explorer, view } = state;
  explorer.state = "running";
  $("run").disabled = true;
  const status = $("status");
  status.classList.remove("bad");
  status.textContent = "running…";
  const started = performance.now();
  try {
    const inputs = readInputs(state);
    const dK = inputs.q.shape[inputs.q.shape.length - 1];
    const { mode, scale, effective } = readScale(dK);
    const causal = readCausal();
    const keyLengths = readKeyLengths(inputs.q.shape);
    const encoding = $("encoding").value;
    const wire = {
      q: encodeTensor(inputs.q, encoding),
      k: encodeTensor(inputs.k, encoding),
      v: encodeTensor(inputs.v, encoding),
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
    const isCapture = inputs.tokens !== undefined;
    // A capture is analysed one head at a time (analyzeHead, after the heatmap is drawn); any
    // other input over all of its heads at once, as the page always did.
    const analyzeRequest = isCapture ? null : { q: wire.q, k: wire.k, causal, key_lengths: keyLengths };
    const strategies = strategiesFor(mode, effective);
    if (analyzeRequest && strategies) analyzeRequest.strategies = strategies;
    explorer.lastRequest = request;
    if (analyzeRequest) explorer.lastAnalyzeRequest = analyzeRequest;

    const [attention, analysis] = await Promise.allSettled([
      postJson("/v1/attention", request),
      analyzeRequest ? postJson("/v1/analyze", analyzeRequest) : Promise.resolve(null),
    ]);
    const roundTrip = performance.now() - started;
    const renderStart = performance.now();

    if (analyzeRequest) applyAnalysis(state, analysis);
    if (attention.status === "rejected") throw attention.reason;
    explorer.lastResponse = attention.value;
    view.result = decodeResult(request, attention.value, inputs);
    view.scaleMode = mode;
    view.strategies = strategies;
    const decoded = performance.now();
    explorer.maskCheck = checkMask(view.result);
    clearError();
    renderSelectors(state);
    renderThumbs(state, (h) => state.selectHead(h));
    renderHeatmap(state);
    renderSummary(state);
    renderMeta(state, roundTrip);
    renderMaskCheck(state);
    if (analyzeRequest && explorer.lastAnalyze) renderAnalyze(explorer.lastAnalyze, mode, view.result.nKv);
    if (isCapture) await analyzeHead(state);
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

function applyAnalysis(state, settled) {
  const { explorer } = state;
  if (settled.status === "fulfilled") {
    explorer.lastAnalyze = settled.value;
    explorer.analyzeError = null;
    $("analyze-error").hidden = true;
    return true;
  }
  explorer.lastAnalyze = null;
  explorer.analyzeError = settled.reason;
  renderProblem($("analyze-error"), toProblem(settled.reason));
  return false;
}

// The seeds' experiment on the selected head of a capture: POST /v1/analyze with that head's
// own q and k (and its mask), so the scaling card says what each strategy would do to it.
// Head switches can overlap; only the newest answer is drawn.
export async function analyzeHead(state) {
  const { explorer, view } = state;
  const r = view.result;
  if (!r || r.layer === null) return;
  const ticket = ++state.analyzeTicket;
  const scope = { layer: r.layer, head: view.head, batch: view.batch };
  explorer.analyzeState = "running";
  try {
    const lastRequest = explorer.lastRequest;
    const request = {
      q: encodeTensor(headOf(r.q, view.batch, view.head), "base64"),
      k: encodeTensor(headOf(r.k, view.batch, view.head), "base64"),
      causal: lastRequest.causal,
      key_lengths: keyLengthsOfHead(lastRequest.key_lengths, view.batch, view.head),
    };
    if (view.strategies) request.strategies = view.strategies;
    explorer.lastAnalyzeRequest = request;
    const settled = await Promise.allSettled([postJson("/v1/analyze", request)]);
    if (ticket !== state.analyzeTicket) return;
    if (applyAnalysis(state, settled[0])) renderAnalyze(explorer.lastAnalyze, view.scaleMode, r.nKv, scope);
    explorer.analyzeScope = scope;
    explorer.analyzeState = settled[0].status === "fulfilled" ? "done" : "error";
  } catch (e) {
    if (ticket !== state.analyzeTicket) return;
    explorer.analyzeState = "error";
    renderProblem($("analyze-error"), toProblem(e));
  }
}

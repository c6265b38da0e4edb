// Canvas drawing: the weight heatmap (one ImageData write, so N = 512 is 262k pixels and no DOM
// per cell), the per-row side chart, head thumbnails and horizontal bar charts.
//
// The heatmap is deterministic so tests can read it back: every cell is a solid block of
// `cell` x `cell` device pixels; a visible cell has exactly colorFor(weight) (nearest-neighbour,
// no smoothing); a masked cell has one of PALETTE.masked (hatched grey: never a colormap
// colour, and distinct from a visible weight of 0, which is the colormap's dark end).

// viridis (matplotlib), 11 stops at 0, 0.1, ..., 1.
const VIRIDIS = [
  "#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c",
  "#22a884", "#44bf70", "#7ad151", "#bddf26", "#fde725",
];

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

export const LUT = (() => {
  const stops = VIRIDIS.map(hexToRgb);
  const lut = new Uint8ClampedArray(256 * 3);
  for (let i = 0; i < 256; i++) {
    const x = (i / 255) * (stops.length - 1);
    const k = Math.min(Math.floor(x), stops.length - 2);
    const f = x - k;
    for (let c = 0; c < 3; c++) {
      lut[i * 3 + c] = Math.round(stops[k][c] + (stops[k + 1][c] - stops[k][c]) * f);
    }
  }
  return lut;
})();

export const PALETTE = {
  masked: ["#d0d0d0", "#a9a9a9"], // base, hatch stripe
  maskedRgb: [hexToRgb("#d0d0d0"), hexToRgb("#a9a9a9")],
  accent: "#3b5bdb",
  accentSoft: "#91a7ff",
  reference: "#e8590c",
  ink: "#1f2430",
  muted: "#5b6270",
  grid: "#e6e8ee",
};

// Linear shade of w on [0, vmax], clipped.
export function linearIndex(w, vmax) {
  if (!(vmax > 0) || !(w > 0)) return 0;
  return Math.round(Math.min(w / vmax, 1) * 255);
}

// Log shade of w on [lo, hi] (w <= lo gets the dark end).
export function logIndex(w, lo, hi) {
  if (!(w > lo)) return 0;
  return Math.round(Math.min(Math.log(w / lo) / Math.log(hi / lo), 1) * 255);
}

export function lutColor(index) {
  const i = index * 3;
  return [LUT[i], LUT[i + 1], LUT[i + 2]];
}

export function isMaskedRgb(r, g, b) {
  return PALETTE.maskedRgb.some(([R, G, B]) => R === r && G === g && B === b);
}

function devicePixelRatioInt() {
  return Math.max(1, Math.round(window.devicePixelRatio || 1));
}

function sizeCanvas(canvas, cssW, cssH) {
  const dpr = devicePixelRatioInt();
  canvas.width = Math.round(cssW * dpr);
  canvas.height = Math.round(cssH * dpr);
  canvas.style.width = `${cssW}px`;
  canvas.style.height = `${cssH}px`;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  return { ctx, dpr };
}

function tickStep(n, maxTicks) {
  for (const s of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]) {
    if (n / s <= maxTicks) return s;
  }
  return Math.ceil(n / maxTicks);
}

const FONT = '11px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif';

export const HEATMAP_MARGIN = { left: 40, top: 22 };

// Draws one head. `shade(i, w)` maps row i's weight w to a LUT index in [0, 255]. Returns the
// geometry in device pixels: cell (i, j) covers x in [x0 + j*cell, x0 + (j+1)*cell),
// y in [y0 + i*cell, y0 + (i+1)*cell).
//
// `labels` ({rows, cols}: one string per query and per key, e.g. a sentence's tokens) replaces the
// index ticks with the strings, keys written upwards along the top; the margins grow to fit the
// longest one. The returned geometry lists where each label was drawn (CSS pixels, its anchor
// at the cell's centre line), so a test can hold the page to the tokens it was given.
export function drawHeatmap(canvas, { weights, nQ, nKv, masked, shade, hatch, labels = null, maxCss = 512 }) {
  const cssCell = Math.max(1, Math.min(40, Math.floor(maxCss / Math.max(nQ, nKv))));
  const { left, top } = labels ? labelMargins(labels) : HEATMAP_MARGIN;
  const { ctx, dpr } = sizeCanvas(canvas, left + nKv * cssCell + 1, top + nQ * cssCell + 1);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const cell = cssCell * dpr;
  const w = nKv * cell;
  const h = nQ * cell;
  const image = ctx.createImageData(w, h);
  const px = image.data;
  const [base, stripe] = PALETTE.maskedRgb;
  const colors = new Uint8ClampedArray(nKv * 3);
  const maskRow = new Uint8Array(nKv);
  for (let i = 0; i < nQ; i++) {
    for (let j = 0; j < nKv; j++) {
      maskRow[j] = masked(i, j) ? 1 : 0;
      if (!maskRow[j]) {
        const c = shade(i, weights[i * nKv + j]) * 3;
        colors[j * 3] = LUT[c];
        colors[j * 3 + 1] = LUT[c + 1];
        colors[j * 3 + 2] = LUT[c + 2];
      }
    }
    for (let y = i * cell; y < (i + 1) * cell; y++) {
      let o = y * w * 4;
      for (let j = 0; j < nKv; j++) {
        const isMasked = maskRow[j] === 1;
        for (let x = j * cell; x < (j + 1) * cell; x++) {
          if (isMasked) {
            // Diagonal stripes in page space, so a masked region reads as one hatched area.
            const rgb = hatch && (x + y) % 8 < 2 ? stripe : base;
            px[o] = rgb[0];
            px[o + 1] = rgb[1];
            px[o + 2] = rgb[2];
          } else {
            px[o] = colors[j * 3];
            px[o + 1] = colors[j * 3 + 1];
            px[o + 2] = colors[j * 3 + 2];
          }
          px[o + 3] = 255;
          o += 4;
        }
      }
    }
  }
  const x0 = left * dpr;
  const y0 = top * dpr;
  ctx.putImageData(image, x0, y0);

  ctx.font = FONT;
  if (labels) {
    const drawn = drawLabels(ctx, labels, { left, top, cssCell, nQ, nKv });
    return { x0, y0, cell, cssCell, nQ, nKv, dpr, cssLeft: left, cssTop: top, labels: drawn };
  }
  // Axes: key index along the top, query index down the left.
  ctx.fillStyle = PALETTE.muted;
  ctx.strokeStyle = PALETTE.muted;
  ctx.lineWidth = 1;
  const stepK = tickStep(nKv, 8);
  ctx.textAlign = "center";
  ctx.textBaseline = "bottom";
  for (let j = 0; j < nKv; j += stepK) {
    const x = left + (j + 0.5) * cssCell;
    ctx.fillText(String(j), x, top - 5);
    ctx.beginPath();
    ctx.moveTo(x, top - 4);
    ctx.lineTo(x, top - 1);
    ctx.stroke();
  }
  const stepQ = tickStep(nQ, 8);
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i < nQ; i += stepQ) {
    const y = top + (i + 0.5) * cssCell;
    ctx.fillText(String(i), left - 6, y);
    ctx.beginPath();
    ctx.moveTo(left - 4, y);
    ctx.lineTo(left - 1, y);
    ctx.stroke();
  }
  return { x0, y0, cell, cssCell, nQ, nKv, dpr, cssLeft: left, cssTop: top, labels: null };
}

const LABEL_FONT = '12px ui-monospace, "SFMono-Regular", Menlo, Consolas, monospace';
const LABEL_GAP = 6;

// Margins that fit the longest row label on the left and the longest key label stood upright
// on top (measured with the font they are drawn in, on a scratch canvas).
function labelMargins(labels) {
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = LABEL_FONT;
  const widest = (texts) => Math.max(0, ...texts.map((t) => ctx.measureText(t).width));
  return {
    left: Math.ceil(widest(labels.rows) + 2 * LABEL_GAP),
    top: Math.ceil(widest(labels.cols) + 2 * LABEL_GAP),
  };
}

function drawLabels(ctx, labels, { left, top, cssCell, nQ, nKv }) {
  ctx.font = LABEL_FONT;
  ctx.fillStyle = PALETTE.ink;
  // Below ~9 px a row of text overlaps its neighbours: label every few cells instead.
  const step = Math.max(1, Math.ceil(12 / cssCell));
  const rows = [];
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i < nQ; i += step) {
    const y = top + (i + 0.5) * cssCell;
    ctx.fillText(labels.rows[i], left - LABEL_GAP, y);
    rows.push({ index: i, text: labels.rows[i], x: left - LABEL_GAP, y });
  }
  const cols = [];
  ctx.textAlign = "left";
  for (let j = 0; j < nKv; j += step) {
    const x = left + (j + 0.5) * cssCell;
    ctx.save();
    ctx.translate(x, top - LABEL_GAP);
    ctx.rotate(-Math.PI / 2);
    ctx.fillText(labels.cols[j], 0, 0);
    ctx.restore();
    cols.push({ index: j, text: labels.cols[j], x, y: top - LABEL_GAP });
  }
  return { rows, cols };
}

export function drawColorbar(canvas, { width = 220, height = 10 }) {
  const { ctx, dpr } = sizeCanvas(canvas, width, height);
  const image = ctx.createImageData(Math.round(width * dpr), Math.round(height * dpr));
  for (let x = 0; x < image.width; x++) {
    const c = Math.round((x / (image.width - 1)) * 255) * 3;
    for (let y = 0; y < image.height; y++) {
      const o = (y * image.width + x) * 4;
      image.data[o] = LUT[c];
      image.data[o + 1] = LUT[c + 1];
      image.data[o + 2] = LUT[c + 2];
      image.data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
}

// A small copy of one head (nearest cell per pixel), fitted into size x size with its aspect.
export function drawThumbnail(canvas, { weights, nQ, nKv, masked, shade, size = 72 }) {
  const cssW = nKv >= nQ ? size : Math.max(8, Math.round((size * nKv) / nQ));
  const cssH = nQ >= nKv ? size : Math.max(8, Math.round((size * nQ) / nKv));
  const { ctx, dpr } = sizeCanvas(canvas, cssW, cssH);
  const w = cssW * dpr;
  const h = cssH * dpr;
  const image = ctx.createImageData(w, h);
  const [base] = PALETTE.maskedRgb;
  for (let y = 0; y < h; y++) {
    const i = Math.min(nQ - 1, Math.floor((y * nQ) / h));
    for (let x = 0; x < w; x++) {
      const j = Math.min(nKv - 1, Math.floor((x * nKv) / w));
      const o = (y * w + x) * 4;
      if (masked(i, j)) {
        image.data.set(base, o);
      } else {
        const c = shade(i, weights[i * nKv + j]) * 3;
        image.data[o] = LUT[c];
        image.data[o + 1] = LUT[c + 1];
        image.data[o + 2] = LUT[c + 2];
      }
      image.data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
}

// Per-row side chart, rows aligned with the heatmap's rows. `values[i]` is the bar for row i;
// `reference[i]` (optional) a per-row bound drawn as a dashed step line; `empty[i]` marks
// rows with no visible key.
// `top` is the heatmap's top margin, so the bars line up with its rows when labels widen it.
export function drawRowChart(canvas, { values, reference, empty, nQ, cssCell, xmax, top = HEATMAP_MARGIN.top, width = 200, format }) {
  const left = 8;
  const right = 14;
  const { ctx } = sizeCanvas(canvas, width, top + nQ * cssCell + 1);
  const plotW = width - left - right;
  const scale = (v) => left + (xmax > 0 ? Math.max(0, Math.min(v / xmax, 1)) * plotW : 0);

  ctx.font = FONT;
  ctx.fillStyle = PALETTE.muted;
  ctx.textBaseline = "bottom";
  ctx.textAlign = "left";
  ctx.fillText("0", left, top - 5);
  ctx.textAlign = "right";
  ctx.fillText(format(xmax), left + plotW, top - 5);
  ctx.strokeStyle = PALETTE.grid;
  ctx.lineWidth = 1;
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    const x = Math.round(left + f * plotW) + 0.5;
    ctx.beginPath();
    ctx.moveTo(x, top);
    ctx.lineTo(x, top + nQ * cssCell);
    ctx.stroke();
  }
  const gap = cssCell >= 4 ? 1 : 0;
  for (let i = 0; i < nQ; i++) {
    const y = top + i * cssCell;
    if (empty && empty[i]) {
      ctx.fillStyle = PALETTE.masked[1];
      ctx.fillRect(left, y + gap / 2, 6, Math.max(1, cssCell - gap));
      continue;
    }
    ctx.fillStyle = PALETTE.accent;
    ctx.fillRect(left, y + gap / 2, scale(values[i]) - left, Math.max(1, cssCell - gap));
  }
  if (reference) {
    ctx.strokeStyle = PALETTE.reference;
    ctx.setLineDash([3, 2]);
    ctx.lineWidth = 1.25;
    ctx.beginPath();
    for (let i = 0; i < nQ; i++) {
      const x = scale(reference[i]);
      if (i === 0) ctx.moveTo(x, top);
      else ctx.lineTo(x, top + i * cssCell);
      ctx.lineTo(x, top + (i + 1) * cssCell);
    }
    ctx.stroke();
    ctx.setLineDash([]);
  }
}

// Horizontal bars, one per row; rows[k] = {label, value, highlight}. "log" puts the axis on
// log10 (score variances span orders of magnitude across divisors).
export function drawBars(canvas, { rows, scale = "linear", domain, refLine, format, width = 300 }) {
  const rowH = 26;
  const top = 8;
  const bottom = 22;
  const labelW = 92;
  const valueW = 62;
  const height = top + rows.length * rowH + bottom;
  const { ctx } = sizeCanvas(canvas, width, height);
  const plotL = labelW;
  const plotW = width - labelW - valueW;
  const [lo, hi] = domain;
  const frac = (v) => {
    if (scale === "log") {
      if (!(v > 0)) return 0;
      return (Math.log10(v) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo));
    }
    return (v - lo) / (hi - lo);
  };
  const xOf = (v) => plotL + Math.max(0, Math.min(1, frac(v))) * plotW;

  ctx.font = FONT;
  // Grid + axis labels.
  const ticks =
    scale === "log"
      ? Array.from({ length: Math.round(Math.log10(hi / lo)) + 1 }, (_, k) => lo * 10 ** k)
      : [lo, (lo + hi) / 2, hi];
  const stride = Math.ceil(ticks.length / 5);
  ctx.strokeStyle = PALETTE.grid;
  ctx.fillStyle = PALETTE.muted;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  ticks.forEach((t, k) => {
    const x = Math.round(xOf(t)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(x, top);
    ctx.lineTo(x, top + rows.length * rowH);
    ctx.stroke();
    if (k % stride === 0 || k === ticks.length - 1) {
      const text = scale === "log" ? `1e${Math.round(Math.log10(t))}` : format(t);
      ctx.fillText(text, x, top + rows.length * rowH + 5);
    }
  });
  rows.forEach((row, k) => {
    const y = top + k * rowH;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    ctx.fillStyle = row.highlight ? PALETTE.ink : PALETTE.muted;
    ctx.font = row.highlight ? `600 ${FONT}` : FONT;
    ctx.fillText(row.label, plotL - 8, y + rowH / 2);
    ctx.fillStyle = row.highlight ? PALETTE.accent : PALETTE.accentSoft;
    const x1 = xOf(row.value);
    ctx.fillRect(plotL, y + 5, Math.max(1, x1 - plotL), rowH - 10);
    ctx.fillStyle = PALETTE.ink;
    ctx.textAlign = "left";
    ctx.font = FONT;
    ctx.fillText(format(row.value), x1 + 5, y + rowH / 2);
  });
  if (refLine) {
    const x = Math.round(xOf(refLine.value)) + 0.5;
    ctx.strokeStyle = PALETTE.reference;
    ctx.setLineDash([4, 3]);
    ctx.beginPath();
    ctx.moveTo(x, top - 4);
    ctx.lineTo(x, top + rows.length * rowH);
    ctx.stroke();
    ctx.setLineDash([]);
  }
}

// Formatting numbers and building DOM nodes: pure helpers, no state.

export const $ = (id) => document.getElementById(id);

// Five significant digits (the browser test compares the table's text at that precision).
export function fmt(x, { integer = false } = {}) {
  if (x === null || x === undefined) return "–";
  if (x === -Infinity) return "−∞";
  if (x === Infinity) return "∞";
  if (Number.isNaN(x)) return "NaN";
  if (integer) return String(Math.round(x));
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(3);
  return x.toPrecision(5);
}

// Three significant digits, for axis ends and bar labels.
export function fmtShort(x) {
  if (!Number.isFinite(x)) return fmt(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-2 || a >= 1e4)) return x.toExponential(1);
  return String(Number(x.toPrecision(3)));
}

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

export function describeTensor(t) {
  return `${t.dtype} [${t.shape.join(", ")}]`;
}

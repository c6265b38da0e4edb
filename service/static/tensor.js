// Tensors in the page: {dtype, shape, values, bits?}. `values` is a Float32Array (float64: a
// Float64Array) in row-major (C) order. Half-precision inputs keep their raw 16-bit patterns in
// `bits` so they go back on the wire bit for bit.

export const ITEM_SIZE = { float16: 2, bfloat16: 2, float32: 4, float64: 8 };

export function product(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

export function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * 2 ** -14 * (frac / 1024);
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * 2 ** (exp - 15) * (1 + frac / 1024);
}

const bf16Scratch = new DataView(new ArrayBuffer(4));
export function bfloat16ToFloat(b) {
  bf16Scratch.setUint32(0, (b & 0xffff) << 16, false);
  return bf16Scratch.getFloat32(0, false);
}

export function bytesToBase64(bytes) {
  const chunk = 0x8000; // String.fromCharCode takes a bounded number of arguments
  let binary = "";
  for (let i = 0; i < bytes.length; i += chunk) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + chunk));
  }
  return btoa(binary);
}

export function base64ToBytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

// Typed arrays use the platform's byte order; every browser this page targets is little-endian,
// which is what the wire's b64 format asks for. Refuse to run silently wrong elsewhere.
const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

export function nest(values, shape) {
  if (shape.length === 0) return toJsonNumber(values[0]);
  let offset = 0;
  const build = (axis) => {
    const n = shape[axis];
    const out = new Array(n);
    if (axis === shape.length - 1) {
      for (let i = 0; i < n; i++) out[i] = toJsonNumber(values[offset++]);
    } else {
      for (let i = 0; i < n; i++) out[i] = build(axis + 1);
    }
    return out;
  };
  return build(0);
}

function toJsonNumber(x) {
  return Number.isFinite(x) ? x : null;
}

// A nested list -> {shape, flat}. Throws on ragged lists and on leaves that are not numbers.
export function flattenNested(data, name) {
  const shape = [];
  let probe = data;
  while (Array.isArray(probe)) {
    shape.push(probe.length);
    probe = probe[0];
  }
  const flat = [];
  const walk = (x, axis, path) => {
    if (axis === shape.length) {
      if (typeof x !== "number" && x !== null) {
        throw new Error(`${name}${path}: expected a number, got ${JSON.stringify(x)}`);
      }
      flat.push(x === null ? NaN : x);
      return;
    }
    if (!Array.isArray(x) || x.length !== shape[axis]) {
      throw new Error(`${name}${path}: ragged list (expected ${shape[axis]} entries)`);
    }
    for (let i = 0; i < x.length; i++) walk(x[i], axis + 1, `${path}[${i}]`);
  };
  walk(data, 0, "");
  return { shape, flat };
}

function valuesFromBytes(bytes, dtype) {
  if (!LITTLE_ENDIAN) throw new Error("this browser is big-endian; use the JSON encoding");
  const buffer = bytes.slice().buffer; // a fresh, aligned buffer
  switch (dtype) {
    case "float32":
      return { values: new Float32Array(buffer) };
    case "float64":
      return { values: new Float64Array(buffer) };
    case "float16": {
      const bits = new Uint16Array(buffer);
      return { values: Float32Array.from(bits, halfToFloat), bits };
    }
    case "bfloat16": {
      const bits = new Uint16Array(buffer);
      return { values: Float32Array.from(bits, bfloat16ToFloat), bits };
    }
    default:
      throw new Error(`unsupported dtype ${JSON.stringify(dtype)}`);
  }
}

// A wire tensor ({dtype, shape, data | b64}, or a bare nested list) -> a page tensor.
export function decodeWireTensor(obj, name) {
  if (Array.isArray(obj) || typeof obj === "number") {
    const { shape, flat } = flattenNested(obj, name);
    return { dtype: "float32", shape, values: Float32Array.from(flat) };
  }
  if (obj === null || typeof obj !== "object") throw new Error(`${name}: not a tensor`);
  const dtype = obj.dtype ?? "float32";
  if (!(dtype in ITEM_SIZE)) throw new Error(`${name}: unsupported dtype ${JSON.stringify(dtype)}`);
  if (typeof obj.b64 === "string") {
    if (!Array.isArray(obj.shape)) throw new Error(`${name}: "b64" needs a "shape"`);
    const bytes = base64ToBytes(obj.b64);
    const expected = product(obj.shape) * ITEM_SIZE[dtype];
    if (bytes.length !== expected) {
      throw new Error(`${name}: ${bytes.length} bytes for shape [${obj.shape}] ${dtype} (expected ${expected})`);
    }
    return { dtype, shape: obj.shape.slice(), ...valuesFromBytes(bytes, dtype) };
  }
  if (obj.data !== undefined) {
    const { shape, flat } = flattenNested(obj.data, name);
    if (Array.isArray(obj.shape) && product(obj.shape) !== flat.length) {
      throw new Error(`${name}: shape [${obj.shape}] does not match ${flat.length} values`);
    }
    const finalShape = Array.isArray(obj.shape) ? obj.shape.slice() : shape;
    const values = dtype === "float64" ? Float64Array.from(flat) : Float32Array.from(flat);
    return { dtype, shape: finalShape, values };
  }
  throw new Error(`${name}: a tensor needs "data" or "b64"`);
}

// A page tensor -> the wire. Half-precision tensors parsed from JSON numbers have no bit
// patterns; they travel as JSON numbers and the server rounds them.
export function encodeTensor(t, encoding) {
  const half = t.dtype === "float16" || t.dtype === "bfloat16";
  if (encoding === "json" || (half && !t.bits)) {
    return { dtype: t.dtype, shape: t.shape, data: nest(t.values, t.shape) };
  }
  if (!LITTLE_ENDIAN) throw new Error("this browser is big-endian; use the JSON encoding");
  let array = t.bits ?? t.values;
  if (t.dtype === "float64" && !(array instanceof Float64Array)) array = Float64Array.from(array);
  if (t.dtype === "float32" && !(array instanceof Float32Array)) array = Float32Array.from(array);
  const bytes = new Uint8Array(array.buffer, array.byteOffset, array.byteLength);
  return { dtype: t.dtype, shape: t.shape, b64: bytesToBase64(bytes) };
}

// Any numeric payload of a response (number, null, nested list or wire tensor) -> flat
// Float64Array; null (the JSON stand-in for -inf) becomes -Infinity.
export function toFlat(x) {
  if (x === null || x === undefined) return new Float64Array([-Infinity]);
  if (typeof x === "number") return new Float64Array([x]);
  if (Array.isArray(x)) {
    const { flat } = flattenNested(x, "value");
    return Float64Array.from(flat, (v) => (Number.isNaN(v) ? -Infinity : v));
  }
  return Float64Array.from(decodeWireTensor(x, "value").values);
}

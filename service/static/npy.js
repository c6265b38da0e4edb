// NumPy .npy reader (format versions 1.0, 2.0 and 3.0; see numpy.lib.format). Floating dtypes
// only: f2, f4, f8 in either byte order. Fortran-ordered arrays are transposed to C order, which
// is the order the wire format and the service expect.

import { halfToFloat, product } from "./tensor.js";

const MAGIC = [0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]; // "\x93NUMPY"
const DTYPES = { f2: "float16", f4: "float32", f8: "float64" };

export class NpyError extends Error {}

function parseHeader(text) {
  const descr = /['"]descr['"]\s*:\s*['"]([^'"]*)['"]/.exec(text);
  const fortran = /['"]fortran_order['"]\s*:\s*(True|False)/.exec(text);
  const shape = /['"]shape['"]\s*:\s*\(([^)]*)\)/.exec(text);
  if (!descr || !fortran || !shape) throw new NpyError(`unreadable .npy header: ${text.trim()}`);
  const dims = shape[1]
    .split(",")
    .map((s) => s.trim().replace(/L$/, ""))
    .filter((s) => s.length > 0)
    .map((s) => {
      const n = Number(s);
      if (!Number.isInteger(n) || n < 0) throw new NpyError(`bad dimension ${JSON.stringify(s)}`);
      return n;
    });
  return { descr: descr[1], fortranOrder: fortran[1] === "True", shape: dims };
}

// Reverse the axes: a Fortran-ordered array's bytes are the C-ordered bytes of its transpose.
export function fortranToC(values, shape) {
  if (shape.length < 2) return values;
  const n = values.length;
  const out = new values.constructor(n);
  const rank = shape.length;
  // Fortran strides of the source, in elements.
  const fStride = new Array(rank);
  let s = 1;
  for (let a = 0; a < rank; a++) {
    fStride[a] = s;
    s *= shape[a];
  }
  const idx = new Array(rank).fill(0);
  for (let c = 0; c < n; c++) {
    let f = 0;
    for (let a = 0; a < rank; a++) f += idx[a] * fStride[a];
    out[c] = values[f];
    for (let a = rank - 1; a >= 0; a--) {
      if (++idx[a] < shape[a]) break;
      idx[a] = 0;
    }
  }
  return out;
}

// The header of a .npy file: {descr, fortranOrder, shape, dataStart, major}. Shared by the float
// reader below and the capture reader (capture.js), whose archives also hold ints, bools and
// strings.
export function npyHeader(buffer, name = "array") {
  const bytes = new Uint8Array(buffer);
  if (bytes.length < 10 || MAGIC.some((b, i) => bytes[i] !== b)) {
    throw new NpyError(`${name}: not a .npy file (missing the \\x93NUMPY magic)`);
  }
  const major = bytes[6];
  const view = new DataView(buffer);
  let headerLen;
  let headerStart;
  if (major === 1) {
    headerLen = view.getUint16(8, true);
    headerStart = 10;
  } else if (major === 2 || major === 3) {
    headerLen = view.getUint32(8, true);
    headerStart = 12;
  } else {
    throw new NpyError(`${name}: .npy format version ${major}.${bytes[7]} is not supported`);
  }
  const dataStart = headerStart + headerLen;
  if (dataStart > bytes.length) throw new NpyError(`${name}: truncated header`);
  const headerBytes = bytes.subarray(headerStart, dataStart);
  const headerText = new TextDecoder(major === 3 ? "utf-8" : "latin1").decode(headerBytes);
  return { ...parseHeader(headerText), dataStart, major };
}

export function parseNpy(buffer, name = "array") {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(buffer);
  const header = npyHeader(buffer, name);
  const dataStart = header.dataStart;

  const m = /^([<>|=])?([a-z])(\d+)$/.exec(header.descr);
  const kindSize = m ? `${m[2]}${m[3]}` : header.descr;
  const dtype = DTYPES[kindSize];
  if (!m || !dtype) {
    throw new NpyError(
      `${name}: dtype ${JSON.stringify(header.descr)} is not supported (use float16, float32 or float64)`,
    );
  }
  const littleEndian = m[1] !== ">";
  const itemSize = Number(m[3]);
  const count = product(header.shape);
  const need = dataStart + count * itemSize;
  if (bytes.length < need) {
    throw new NpyError(`${name}: ${bytes.length - dataStart} data bytes, shape [${header.shape}] needs ${count * itemSize}`);
  }

  let values;
  let bits;
  if (dtype === "float16") {
    bits = new Uint16Array(count);
    for (let i = 0; i < count; i++) bits[i] = view.getUint16(dataStart + 2 * i, littleEndian);
  } else if (dtype === "float32") {
    values = new Float32Array(count);
    for (let i = 0; i < count; i++) values[i] = view.getFloat32(dataStart + 4 * i, littleEndian);
  } else {
    values = new Float64Array(count);
    for (let i = 0; i < count; i++) values[i] = view.getFloat64(dataStart + 8 * i, littleEndian);
  }
  if (header.fortranOrder) {
    if (bits) bits = fortranToC(bits, header.shape);
    else values = fortranToC(values, header.shape);
  }
  if (bits) values = Float32Array.from(bits, halfToFloat);
  return { dtype, shape: header.shape, values, ...(bits ? { bits } : {}) };
}

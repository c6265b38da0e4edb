// Captures: the .npz files `sdpa-tap capture` writes (sdpa_client/tap/cli.py), read in the
// browser. An .npz is a zip of .npy files (np.savez: stored; np.savez_compressed: deflate),
// so this is a small zip reader (central directory, methods 0 and 8, inflated by the
// browser's own DecompressionStream) and a .npy reader for the dtypes a capture holds:
// floats (q, k, v, scale, masks), integers (input_ids, attention_mask, layers), bools
// (causal, boolean masks) and fixed-width unicode strings (tokens).
//
// parseCapture() returns {name, tokens: string[][] (per sequence), lengths: number[] (real
// tokens per sequence, from attention_mask), layers: [{layer, q, k, v, scale, causal}]}, with
// q/k/v page tensors ({dtype, shape, values}) as tensor.js defines them.

import { NpyError, fortranToC, npyHeader, parseNpy } from "./npy.js";
import { product } from "./tensor.js";

export class CaptureError extends Error {}

// The capture the page opens on, and the command that made it: service/static/capture/README.md.
export const DEFAULT_CAPTURE_URL = "/static/capture/minilm-sentence.npz";

const EOCD_SIGNATURE = 0x06054b50;
const CENTRAL_SIGNATURE = 0x02014b50;
const LOCAL_SIGNATURE = 0x04034b50;

async function inflateRaw(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate-raw"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

// name -> ArrayBuffer of every member of a zip archive.
export async function readZip(buffer, fileName = "archive") {
  const view = new DataView(buffer);
  const bytes = new Uint8Array(buffer);
  // The end-of-central-directory record is the last 22 bytes, plus a comment of up to 64 KiB.
  let eocd = -1;
  for (let o = bytes.length - 22; o >= Math.max(0, bytes.length - 22 - 0xffff); o--) {
    if (view.getUint32(o, true) === EOCD_SIGNATURE) {
      eocd = o;
      break;
    }
  }
  if (eocd < 0) throw new CaptureError(`${fileName}: not an .npz file (no zip directory found)`);
  const entries = view.getUint16(eocd + 10, true);
  let offset = view.getUint32(eocd + 16, true);
  if (offset === 0xffffffff) throw new CaptureError(`${fileName}: zip64 archives are not supported`);
  const members = new Map();
  for (let e = 0; e < entries; e++) {
    if (view.getUint32(offset, true) !== CENTRAL_SIGNATURE) {
      throw new CaptureError(`${fileName}: damaged zip directory (entry ${e})`);
    }
    const method = view.getUint16(offset + 10, true);
    const compressedSize = view.getUint32(offset + 20, true);
    const nameLen = view.getUint16(offset + 28, true);
    const extraLen = view.getUint16(offset + 30, true);
    const commentLen = view.getUint16(offset + 32, true);
    const localOffset = view.getUint32(offset + 42, true);
    const name = new TextDecoder().decode(bytes.subarray(offset + 46, offset + 46 + nameLen));
    offset += 46 + nameLen + extraLen + commentLen;
    if (view.getUint32(localOffset, true) !== LOCAL_SIGNATURE) {
      throw new CaptureError(`${fileName}: damaged zip member ${name}`);
    }
    // The local header's own name/extra lengths can differ from the central directory's.
    const dataStart =
      localOffset + 30 + view.getUint16(localOffset + 26, true) + view.getUint16(localOffset + 28, true);
    const raw = bytes.subarray(dataStart, dataStart + compressedSize);
    let data;
    if (method === 0) data = raw.slice();
    else if (method === 8) data = await inflateRaw(raw);
    else throw new CaptureError(`${fileName}: ${name} uses zip method ${method} (only stored and deflate are read)`);
    members.set(name, data.buffer);
  }
  return members;
}

const INT_READERS = {
  i1: (v, o) => v.getInt8(o),
  u1: (v, o) => v.getUint8(o),
  i2: (v, o, le) => v.getInt16(o, le),
  u2: (v, o, le) => v.getUint16(o, le),
  i4: (v, o, le) => v.getInt32(o, le),
  u4: (v, o, le) => v.getUint32(o, le),
  i8: (v, o, le) => Number(v.getBigInt64(o, le)),
  u8: (v, o, le) => Number(v.getBigUint64(o, le)),
  b1: (v, o) => v.getUint8(o) !== 0,
};

// Any .npy array a capture holds -> {shape, values: a plain array (or a page tensor for floats)}.
export function parseNpyAny(buffer, name) {
  const header = npyHeader(buffer, name);
  const m = /^([<>|=])?([a-zA-Z])(\d+)$/.exec(header.descr);
  if (!m) throw new NpyError(`${name}: dtype ${JSON.stringify(header.descr)} is not supported`);
  const [, order, kind, size] = m;
  if (kind === "f") return { float: true, ...parseNpy(buffer, name) };
  const le = order !== ">";
  const view = new DataView(buffer);
  const count = product(header.shape);
  let values = new Array(count);
  if (kind === "U") {
    // numpy's unicode: `size` UTF-32 code points per item, NUL-padded.
    const width = Number(size);
    for (let i = 0; i < count; i++) {
      let text = "";
      for (let c = 0; c < width; c++) {
        const point = view.getUint32(header.dataStart + (i * width + c) * 4, le);
        if (point === 0) break;
        text += String.fromCodePoint(point);
      }
      values[i] = text;
    }
  } else {
    const read = INT_READERS[`${kind}${size}`];
    if (!read) throw new NpyError(`${name}: dtype ${JSON.stringify(header.descr)} is not supported`);
    const item = Number(size);
    for (let i = 0; i < count; i++) values[i] = read(view, header.dataStart + i * item, le);
  }
  if (header.fortranOrder) values = Array.from(fortranToC(values, header.shape));
  return { float: false, shape: header.shape, values };
}

function rows(array, name) {
  if (array.shape.length !== 2) throw new CaptureError(`${name} should be [sequences, tokens], is [${array.shape}]`);
  const [n, width] = array.shape;
  return Array.from({ length: n }, (_, b) => Array.from(array.values).slice(b * width, (b + 1) * width));
}

export async function parseCapture(buffer, fileName = "capture.npz") {
  const members = await readZip(buffer, fileName);
  const arrays = new Map();
  for (const [member, data] of members) {
    if (!member.endsWith(".npy")) continue;
    arrays.set(member.slice(0, -4), parseNpyAny(data, `${fileName}: ${member}`));
  }
  const need = (key) => {
    const a = arrays.get(key);
    if (!a) throw new CaptureError(`${fileName}: no "${key}" array (is this a file from sdpa-tap capture?)`);
    return a;
  };
  const tokens = rows(need("tokens"), "tokens");
  const mask = arrays.get("attention_mask");
  const lengths = mask
    ? rows(mask, "attention_mask").map((r) => r.reduce((a, b) => a + Number(b), 0))
    : tokens.map((r) => r.length);
  const layerIds = [...new Set([...arrays.keys()].map((k) => /^layer(\d+)_q$/.exec(k)).filter(Boolean).map((m) => Number(m[1])))];
  layerIds.sort((a, b) => a - b);
  if (layerIds.length === 0) throw new CaptureError(`${fileName}: no layer<i>_q arrays`);
  const layers = layerIds.map((layer) => {
    const get = (what) => need(`layer${layer}_${what}`);
    const [q, k, v] = ["q", "k", "v"].map((what) => {
      const a = get(what);
      if (!a.float || a.shape.length !== 4) {
        throw new CaptureError(`${fileName}: layer${layer}_${what} should be a float [B, H, N, D] array`);
      }
      return { dtype: a.dtype, shape: a.shape, values: a.values, ...(a.bits ? { bits: a.bits } : {}) };
    });
    const scaleArray = arrays.get(`layer${layer}_scale`);
    const scale = scaleArray ? Number(scaleArray.values[0]) : NaN;
    const causalArray = arrays.get(`layer${layer}_causal`);
    return {
      layer,
      q,
      k,
      v,
      // NaN in the file: the model left the scale to its kernel's default, 1/sqrt(d_k).
      scale: Number.isFinite(scale) ? scale : null,
      causal: causalArray ? Boolean(causalArray.values[0]) : false,
    };
  });
  const nTokens = layers[0].q.shape[2];
  if (tokens.some((r) => r.length !== nTokens)) {
    throw new CaptureError(`${fileName}: ${tokens[0].length} tokens but q has ${nTokens} positions`);
  }
  return { name: fileName, tokens, lengths, layers };
}

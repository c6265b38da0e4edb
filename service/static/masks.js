// Which (query, key) cells the request's mask options hide, computed on the client from the same
// rules the service uses (sdpa_core's masks):
//   causal "top_left" (= true): query i sees keys j <= i
//   causal "bottom_right":      query i sees keys j <= i + N_kv - N_q
//   key_lengths:                keys j >= length are padding; one length per sequence
//                               (shape q.shape[:-3]) or per head (shape q.shape[:-2])
// Visibility from every option combines by logical AND. The page checks its counts against the
// service's per-row visible_keys, so a disagreement is shown rather than drawn wrongly.

import { product } from "./tensor.js";

export function causalAlignment(causal) {
  if (causal === true) return "top_left";
  if (causal === false || causal === null || causal === undefined || causal === "none") return "none";
  return causal;
}

export function maskModel({ qShape, kShape, causal, keyLengths }) {
  const rank = qShape.length;
  const nQ = qShape[rank - 2];
  const nKv = kShape[kShape.length - 2];
  const heads = rank >= 3 ? qShape[rank - 3] : 1;
  const batchShape = rank >= 3 ? qShape.slice(0, rank - 3) : [];
  const batches = product(batchShape);
  const align = causalAlignment(causal);
  const offset = align === "bottom_right" ? nKv - nQ : 0;

  let lengths = null; // per slice (batch * heads + head)
  if (keyLengths !== null && keyLengths !== undefined) {
    const flat = [keyLengths].flat(Infinity).map(Number);
    lengths = new Int32Array(batches * heads);
    if (flat.length === batches) {
      for (let s = 0; s < lengths.length; s++) lengths[s] = flat[Math.floor(s / heads)];
    } else if (flat.length === batches * heads) {
      lengths.set(flat);
    } else {
      throw new Error(
        `key_lengths has ${flat.length} entries; expected ${batches} (one per sequence) or ${batches * heads} (one per head)`,
      );
    }
  }

  const visible = (slice, i, j) =>
    (align === "none" || j <= i + offset) && (lengths === null || j < lengths[slice]);

  const visibleCount = (slice, i) => {
    let limit = nKv;
    if (align !== "none") limit = Math.min(limit, i + offset + 1);
    if (lengths !== null) limit = Math.min(limit, lengths[slice]);
    return Math.max(0, limit);
  };

  return {
    nQ,
    nKv,
    heads,
    batchShape,
    batches,
    align,
    lengths,
    visible,
    masked: (slice, i, j) => !visible(slice, i, j),
    visibleCount,
  };
}

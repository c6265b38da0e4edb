// Seeded synthetic inputs. mulberry32 gives uniforms in [0, 1); Box-Muller turns pairs of them
// into standard normals (both the cosine and the sine draw are used, in that order). Q, K and V
// are drawn from one stream in that order, row-major, so a seed names one exact input.

export function mulberry32(seed) {
  let a = seed >>> 0;
  return function next() {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export function normalStream(seed) {
  const uniform = mulberry32(seed);
  let spare = null;
  return function next() {
    if (spare !== null) {
      const s = spare;
      spare = null;
      return s;
    }
    let u1 = uniform();
    while (u1 === 0) u1 = uniform(); // log(0) would be -inf
    const u2 = uniform();
    const r = Math.sqrt(-2 * Math.log(u1));
    spare = r * Math.sin(2 * Math.PI * u2);
    return r * Math.cos(2 * Math.PI * u2);
  };
}

function fill(next, shape, std) {
  const n = shape.reduce((a, b) => a * b, 1);
  const values = new Float32Array(n);
  for (let i = 0; i < n; i++) values[i] = next() * std;
  return { dtype: "float32", shape, values };
}

// Shapes are 4-D [1, H, N, D]: one sequence, so key_lengths is [B] = [1] or per head [1, H].
export function syntheticQKV({ heads, nQ, nKv, dK, dV, std, seed }) {
  const next = normalStream(seed);
  return {
    q: fill(next, [1, heads, nQ, dK], std),
    k: fill(next, [1, heads, nKv, dK], std),
    v: fill(next, [1, heads, nKv, dV], std),
  };
}

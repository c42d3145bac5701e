/**
 * Fusion math, as Python's `edge_sdk.fusion`: small pure functions over one step's full-vocabulary rows.
 *
 * Two fusion spaces: `"prob"` (`p_fuse = alpha * p_llm + (1 - alpha) * p_slm`, the paper's) and `"logit"`
 * (`z_fuse = alpha * z_llm + (1 - alpha) * z_slm`, the authors' release).  Rows are `Float32Array`s and every
 * operation rounds where numpy's float32 arithmetic rounds (each product and sum through `Math.fround`: a float32
 * `+ - * /` done in float64 and rounded once is the float32 result), so decisions and uploads agree with Python's
 * bit for bit.  `TopK` returns ids by decreasing value, ties to the lower id; `argmax` breaks ties the same way.
 */

import { InvalidArgumentError, NonFiniteError } from "./errors.js";

export type FusionSpace = "prob" | "logit";
export const FUSION_SPACES: readonly FusionSpace[] = ["prob", "logit"];

const f32 = Math.fround;

/** float32's most negative finite value: the lowest a logit row holds (a masked or excluded id). */
export const FLOAT32_LOWEST = -3.4028234663852886e38;
/** float32's smallest positive normal value. */
export const FLOAT32_TINY = 1.1754943508222875e-38;

/** `space` if it names a fusion space, else `InvalidArgumentError`. */
export function checkSpace(space: string): FusionSpace {
  if (space !== "prob" && space !== "logit") {
    throw new InvalidArgumentError(`fusion space must be one of ('prob', 'logit'), got '${space}'`);
  }
  return space;
}

/** `alpha` if `0 <= alpha <= 1`, else `InvalidArgumentError`. */
export function checkAlpha(alpha: number): number {
  if (!(alpha >= 0 && alpha <= 1)) {
    throw new InvalidArgumentError(`fusion weight alpha must lie in [0, 1], got ${alpha}`);
  }
  return alpha;
}

/** `values` if every entry is finite, else `NonFiniteError` naming `what` and the first bad id. */
export function checkFinite(values: Float32Array, what: string): Float32Array {
  for (let i = 0; i < values.length; i++) {
    if (!Number.isFinite(values[i])) {
      let count = 0;
      for (let j = i; j < values.length; j++) if (!Number.isFinite(values[j])) count++;
      throw new NonFiniteError(
        `${what} holds ${count} non-finite value(s) (first at id ${i}: ${values[i]}); refusing to rank or fuse it`,
      );
    }
  }
  return values;
}

/** The lowest value a row of `space` holds: 0 for probabilities, float32's minimum for logits. */
export function lowestOf(space: FusionSpace): number {
  return space === "logit" ? FLOAT32_LOWEST : 0;
}

/**
 * numpy's pairwise summation of `values[start, start + n)` (`np.add.reduce`): blocks of at most 128 summed with
 * eight running sums, halves summed recursively.  `float32`: every partial sum rounded to float32 (`np.sum` of a
 * float32 row), else float64 (a row summed with `dtype=np.float64`).
 */
export function pairwiseSum(values: ArrayLike<number>, start: number, n: number, float32: boolean): number {
  const round = (x: number): number => (float32 ? f32(x) : x);
  if (n < 8) {
    let sum = 0;
    for (let i = 0; i < n; i++) sum = round(sum + values[start + i]);
    return sum;
  }
  if (n <= 128) {
    let r0 = values[start];
    let r1 = values[start + 1];
    let r2 = values[start + 2];
    let r3 = values[start + 3];
    let r4 = values[start + 4];
    let r5 = values[start + 5];
    let r6 = values[start + 6];
    let r7 = values[start + 7];
    let i = 8;
    for (; i < n - (n % 8); i += 8) {
      const at = start + i;
      r0 = round(r0 + values[at]);
      r1 = round(r1 + values[at + 1]);
      r2 = round(r2 + values[at + 2]);
      r3 = round(r3 + values[at + 3]);
      r4 = round(r4 + values[at + 4]);
      r5 = round(r5 + values[at + 5]);
      r6 = round(r6 + values[at + 6]);
      r7 = round(r7 + values[at + 7]);
    }
    let sum = round(round(round(r0 + r1) + round(r2 + r3)) + round(round(r4 + r5) + round(r6 + r7)));
    for (; i < n; i++) sum = round(sum + values[start + i]);
    return sum;
  }
  let half = Math.floor(n / 2);
  half -= half % 8;
  return round(pairwiseSum(values, start, half, float32) + pairwiseSum(values, start + half, n - half, float32));
}

/** `sum(values)` in float32, as `np.sum` of a float32 array. */
export function sumFloat32(values: ArrayLike<number>): number {
  return pairwiseSum(values, 0, values.length, true);
}

/** `sum(values, dtype=np.float64)`. */
export function sumFloat64(values: ArrayLike<number>): number {
  return pairwiseSum(values, 0, values.length, false);
}

/** `p(i) = exp(z(i)/T - max z/T) / sum_j exp(...)` in float32 (the exponentials through float64, rounded once, as
 * Python's `edge_sdk.fusion.softmax` takes them; a row differs from Python's only where `Math.exp` and numpy's
 * float64 `exp` round apart before that rounding). */
export function softmax(logits: Float32Array, temperature = 1.0): Float32Array {
  if (!(temperature > 0)) throw new InvalidArgumentError(`temperature must be positive, got ${temperature}`);
  let top = -Infinity;
  for (let i = 0; i < logits.length; i++) if (logits[i] > top) top = logits[i];
  const out = new Float32Array(logits.length);
  const t = f32(temperature);
  for (let i = 0; i < logits.length; i++) {
    const shifted = temperature === 1.0 ? f32(logits[i] - top) : f32(f32(logits[i] - top) / t);
    out[i] = Math.exp(shifted);
  }
  const total = sumFloat32(out);
  for (let i = 0; i < out.length; i++) out[i] = out[i] / total;
  return out;
}

const scratchRows = new Map<string, Float32Array>();

/**
 * A float32 work row of length `n` kept per `slot` and reused (a fresh megabyte-sized typed array per step costs
 * several argmax passes in page faults and collection).  Its contents are the caller's until the next call with
 * the same slot: only for rows that do not outlive the call that fills them.
 */
export function scratch(n: number, slot: string): Float32Array {
  let row = scratchRows.get(slot);
  if (row === undefined || row.length !== n) {
    row = new Float32Array(n);
    scratchRows.set(slot, row);
  }
  return row;
}

/** `alpha * p_llm + (1 - alpha) * p_slm` (probabilities or logits alike), float32. */
export function fuse(pLlm: Float32Array, pSlm: Float32Array, alpha: number, out?: Float32Array): Float32Array {
  const a = f32(alpha);
  const b = f32(1.0 - alpha);
  const result = out ?? new Float32Array(pLlm.length);
  for (let i = 0; i < pLlm.length; i++) result[i] = f32(pLlm[i] * a) + f32(pSlm[i] * b);
  return result;
}

/** The cloud's masked fusion of a sparse upload: `alpha * p_llm(i) + (1 - alpha) * m(i) * u(i)`. */
export function fuseUpload(
  pLlm: Float32Array, ids: ArrayLike<number>, values: ArrayLike<number>, alpha: number, into?: Float32Array,
): Float32Array {
  const a = f32(alpha);
  const b = f32(1.0 - alpha);
  const out = into ?? new Float32Array(pLlm.length);
  for (let i = 0; i < pLlm.length; i++) out[i] = pLlm[i] * a;
  for (let j = 0; j < ids.length; j++) out[ids[j]] = out[ids[j]] + f32(b * values[j]);
  return out;
}

/** `argmax values`, ties to the lower id (numpy's first occurrence). */
export function argmax(values: ArrayLike<number>): number {
  let best = 0;
  let top = values[0];
  for (let i = 1; i < values.length; i++) {
    if (values[i] > top) {
      top = values[i];
      best = i;
    }
  }
  return best;
}

/** `argmin values`, ties to the first. */
export function argmin(values: ArrayLike<number>): number {
  let best = 0;
  let low = values[0];
  for (let i = 1; i < values.length; i++) {
    if (values[i] < low) {
      low = values[i];
      best = i;
    }
  }
  return best;
}

/** `ids` ordered by decreasing `values[id]`, ties by increasing id (a fresh array). */
export function sortedByValue(values: ArrayLike<number>, ids: ArrayLike<number>): number[] {
  return Array.from(ids).sort((x, y) => (values[y] - values[x]) || (x - y));
}

/** Whether id `a` ranks below id `b` in `values`: a smaller value, or an equal value and a higher id. */
function weaker(values: ArrayLike<number>, a: number, b: number): boolean {
  return values[a] < values[b] || (values[a] === values[b] && a > b);
}

/** Restore the min-heap `heap[0, size)` (weakest id first) below position `at`. */
function siftDown(values: ArrayLike<number>, heap: Int32Array, size: number, at: number): void {
  for (;;) {
    const left = 2 * at + 1;
    const right = left + 1;
    let low = at;
    if (left < size && weaker(values, heap[left], heap[low])) low = left;
    if (right < size && weaker(values, heap[right], heap[low])) low = right;
    if (low === at) return;
    const moved = heap[at];
    heap[at] = heap[low];
    heap[low] = moved;
    at = low;
  }
}

/**
 * `TopK(values)`: the `k` ids of largest value, by decreasing value, ties to the lower id.
 *
 * One pass keeps the best `k` in a min-heap (its root the weakest kept: the smallest value, the higher id on
 * ties); ids come in increasing order, so a later id that only ties the root never displaces it, and an id is
 * looked at twice only when it beats the root.  The result equals sorting the whole row, ties included.
 */
export function topKIds(values: ArrayLike<number>, k: number): number[] {
  const n = values.length;
  if (k <= 0) return [];
  if (k >= n) return sortedByValue(values, Array.from({ length: n }, (_, i) => i));
  const heap = new Int32Array(k);
  for (let size = 0; size < k; size++) {
    heap[size] = size;
    for (let at = size; at > 0;) {
      const parent = (at - 1) >> 1;
      if (!weaker(values, heap[at], heap[parent])) break;
      const moved = heap[at];
      heap[at] = heap[parent];
      heap[parent] = moved;
      at = parent;
    }
  }
  let floor = values[heap[0]];
  for (let i = k; i < n; i++) {
    if (values[i] > floor) {
      heap[0] = i;
      siftDown(values, heap, k, 0);
      floor = values[heap[0]];
    }
  }
  return sortedByValue(values, heap);
}

/**
 * Whether id `i` belongs to `TopK(values)` (same tie rule) without selecting it:
 * `rank(i) = |{j : v_j > v_i}| + |{j < i : v_j = v_i}|` and `i` is in iff `rank(i) < k`.  A pass counts the ids
 * at least `v_i` and stops once they exceed `k` (when at most `k` are, `i` is in whatever the ties); only then
 * does a second pass count the rank, stopping once it reaches `k`.  Either pass ends after about `k` hits, so a
 * hit is rare and its branch well predicted.
 */
export function inTopK(values: ArrayLike<number>, i: number, k: number): boolean {
  if (k <= 0) return false;
  const v = values[i];
  const n = values.length;
  let atLeast = 0;
  for (let j = 0; j < n; j++) {
    if (values[j] >= v && ++atLeast > k) break;
  }
  if (atLeast <= k) return true;
  let rank = 0;
  for (let j = 0; j < n; j++) {
    if ((values[j] > v || (values[j] === v && j < i)) && ++rank >= k) return false;
  }
  return true;
}

/** Slack for comparing float32-derived values: `1e-6 * |value| + 1e-12`. */
export function roundingMargin(value: number): number {
  return 1e-6 * Math.abs(value) + 1e-12;
}

/** Uniform draws a randomised policy consumes: `random()` a float64 in [0, 1), `randomRaw(n)` 64-bit words. */
export interface Draws {
  random(): number;
  randomRaw(n: number): BigUint64Array;
}

/**
 * Draws from the operating system's entropy (`crypto.getRandomValues`), as the SDK must seed its policies:
 * anything derived from what crosses the wire would let the cloud replay the policy's noise.  `random()` is a
 * 64-bit word's top 53 bits times 2^-53, as numpy's `Generator.random()` turns a word into a uniform.
 */
export const osDraws: Draws = {
  random(): number {
    const word = globalThis.crypto.getRandomValues(new BigUint64Array(1))[0];
    return Number(word >> 11n) * 2 ** -53;
  },
  randomRaw(n: number): BigUint64Array {
    const words = new BigUint64Array(n);
    for (let start = 0; start < n; start += 8192) { // getRandomValues fills at most 65,536 bytes a call
      globalThis.crypto.getRandomValues(words.subarray(start, Math.min(start + 8192, n)));
    }
    return words;
  },
};

/**
 * One draw of an id with probability `weights(i) / sum(weights)`: one uniform and a cumulative sum (float64),
 * the first id whose cumulative weight exceeds `u * total` (numpy's `searchsorted(side="right")`).
 */
export function sampleFrom(weights: ArrayLike<number>, draws: Draws): number {
  const cdf = new Float64Array(weights.length);
  let running = 0;
  for (let i = 0; i < weights.length; i++) {
    running += weights[i];
    cdf[i] = running;
  }
  const total = cdf[cdf.length - 1];
  if (!Number.isFinite(total) || !(total > 0)) {
    throw new InvalidArgumentError("cannot sample: weights must be finite, non-negative and not all zero");
  }
  const target = draws.random() * total;
  let low = 0;
  let high = cdf.length;
  while (low < high) {
    const middle = (low + high) >> 1;
    if (cdf[middle] <= target) low = middle + 1;
    else high = middle;
  }
  return Math.min(low, cdf.length - 1);
}

/** Greedy `argmax p` at temperature 0, else a draw from `p**(1/T)` renormalised (`p` non-negative). */
export function pickToken(p: Float32Array, temperature: number, draws?: Draws): number {
  if (temperature === 0) return argmax(p);
  if (draws === undefined) throw new InvalidArgumentError("sampling at temperature > 0 needs explicit draws");
  // p**(1/T) / max p**(1/T) = exp((log p - log max p) / T)
  const logP = new Float64Array(p.length);
  let top = -Infinity;
  for (let i = 0; i < p.length; i++) {
    logP[i] = Math.log(Math.max(p[i], 0));
    if (logP[i] > top) top = logP[i];
  }
  const weights = new Float64Array(p.length);
  for (let i = 0; i < p.length; i++) weights[i] = Math.exp((logP[i] - top) / temperature);
  return sampleFrom(weights, draws);
}

/** Ids per block of {@link sampleIndex}'s two-level inverse CDF. */
export const SAMPLE_BLOCK = 512;

/**
 * Repeated draws of an id with probability `weights(i) / sum(weights)`, two uniforms per draw (Python's
 * `BlockSampler`): the ids are cut into blocks of {@link SAMPLE_BLOCK}, each block summed once in float64 (numpy's
 * pairwise sum); a draw picks a block by its sum, then an id inside it.
 */
export class BlockSampler {
  private readonly sums: Float64Array;

  constructor(private readonly weights: Float32Array | Float64Array) {
    const n = weights.length;
    const full = Math.floor(n / SAMPLE_BLOCK);
    this.sums = new Float64Array(full + (full * SAMPLE_BLOCK < n ? 1 : 0));
    for (let b = 0; b < full; b++) this.sums[b] = pairwiseSum(weights, b * SAMPLE_BLOCK, SAMPLE_BLOCK, false);
    if (full * SAMPLE_BLOCK < n) {
      this.sums[full] = pairwiseSum(weights, full * SAMPLE_BLOCK, n - full * SAMPLE_BLOCK, false);
    }
  }

  draw(draws: Draws): number {
    const start = sampleFrom(this.sums, draws) * SAMPLE_BLOCK;
    return start + sampleFrom(this.weights.subarray(start, start + SAMPLE_BLOCK), draws);
  }
}

/** One draw of an id with probability `weights(i) / sum(weights)` (Python's `sample_index`): one
 * {@link sampleFrom} up to {@link SAMPLE_BLOCK} ids, a {@link BlockSampler} draw beyond. */
export function sampleIndex(weights: Float32Array | Float64Array, draws: Draws): number {
  if (weights.length <= SAMPLE_BLOCK) return sampleFrom(weights, draws);
  return new BlockSampler(weights).draw(draws);
}

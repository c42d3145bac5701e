/**
 * The cloud's next-token row of one step, sparse or full (Python: `edge_sdk.wire.CloudDistribution`).
 */

import type { FusionSpace } from "./session.js";

/** float32's lowest finite value: the floor of a logit row (exact in float32). */
export const FLOAT32_LOWEST = -3.4028234663852886e38;

/**
 * `TopK(values)`: the `k` ids of largest value, by decreasing value, ties to the lower id (Python:
 * `edge_sdk.fusion.top_k_ids`).  One pass keeping the best `k` in order.
 */
export function topKIds(values: ArrayLike<number>, k: number): Int32Array {
  const n = values.length;
  k = Math.max(0, Math.min(k, n));
  const ids = new Int32Array(k);
  let size = 0;
  for (let i = 0; i < n; i++) {
    const v = values[i];
    if (size === k && !(v > values[ids[k - 1]])) continue; // an equal value keeps the lower id already held
    let j = size < k ? size++ : k - 1;
    while (j > 0 && v > values[ids[j - 1]]) {
      ids[j] = ids[j - 1];
      j--;
    }
    ids[j] = i;
  }
  return ids;
}

/**
 * `sum(a[start:start + n])` in numpy's order (its pairwise summation of a contiguous float64 array: blocks of at
 * most 128 summed in 8 lanes, halves summed recursively), so a sum matches numpy's to the last bit.
 */
export function pairwiseSum(a: Float64Array, start: number, n: number): number {
  if (n < 8) {
    let res = 0;
    for (let i = 0; i < n; i++) res += a[start + i];
    return res;
  }
  if (n <= 128) {
    const r = Array.from(a.subarray(start, start + 8));
    let i = 8;
    for (; i < n - (n % 8); i += 8) for (let j = 0; j < 8; j++) r[j] += a[start + i + j];
    let res = (r[0] + r[1] + (r[2] + r[3])) + (r[4] + r[5] + (r[6] + r[7]));
    for (; i < n; i++) res += a[start + i];
    return res;
  }
  let half = Math.floor(n / 2);
  half -= half % 8;
  return pairwiseSum(a, start, half) + pairwiseSum(a, start + half, n - half);
}

/**
 * Sparse: exact `values` at `ids` (by decreasing value), every omitted entry at most `tailBound`, together holding
 * `tailMass`.  Full: `dense` holds every id's value.
 */
export class CloudDistribution {
  constructor(
    readonly step: number,
    readonly ids: Uint32Array = new Uint32Array(0),
    readonly values: Float32Array = new Float32Array(0),
    readonly tailBound = 0,
    readonly tailMass = 0,
    readonly dense: Float32Array | null = null,
    readonly forwardNs = 0,
    /** run-ahead: the token at `step - 1` this row was computed after (`null`: lockstep, or the first step) */
    readonly assumesToken: number | null = null,
  ) {}

  get isFull(): boolean {
    return this.dense !== null;
  }

  /**
   * A dense row exact where known and `fill` where omitted (`fill` a lower bound of every omitted value); `out`,
   * a float32 buffer of `vocabSize` reused across steps.
   */
  lowerDense(vocabSize: number, out?: Float32Array, fill = 0): Float32Array {
    if (this.dense !== null) return this.dense;
    const row = out ?? new Float32Array(vocabSize);
    row.fill(fill);
    for (let j = 0; j < this.ids.length; j++) row[this.ids[j]] = this.values[j];
    return row;
  }

  /**
   * The value a sparse row's omitted ids stand at when the edge decides from it, read off what the cloud sent
   * only: the omitted ids share the omitted mass evenly, at most the tail bound `b`:
   *
   *     prob:   fill = min(b, tail_mass / n_omitted)
   *     logit:  fill = min(b, log(tail_mass / n_omitted) + log Z),  log Z = logsumexp(sent) - log(1 - tail_mass)
   *
   * A row listing every id, or a tail mass of 0, fills with the space's lowest value.
   */
  publicFill(vocabSize: number, space: FusionSpace): number {
    const omitted = vocabSize - this.ids.length;
    const lowest = space === "logit" ? FLOAT32_LOWEST : 0;
    if (this.dense !== null || omitted <= 0 || this.tailMass <= 0) return lowest;
    const share = this.tailMass / omitted;
    if (space === "prob") return Math.min(this.tailBound, share);
    if (!(this.tailMass < 1) || !this.values.length) return this.tailBound;
    let top = -Infinity;
    for (const v of this.values) top = Math.max(top, v);
    const shifted = new Float64Array(this.values.length);
    for (let j = 0; j < shifted.length; j++) shifted[j] = Math.exp(this.values[j] - top);
    const logZ = top + Math.log(pairwiseSum(shifted, 0, shifted.length)) - Math.log1p(-this.tailMass);
    return Math.min(this.tailBound, Math.log(share) + logZ);
  }

  /** The row exact where sent and at {@link publicFill} where omitted (the full row itself when dense). */
  filled(vocabSize: number, space: FusionSpace, out?: Float32Array): Float32Array {
    return this.lowerDense(vocabSize, out, this.publicFill(vocabSize, space));
  }

  /** `TopK` of the cloud's row; a sparse row must hold at least `k` ids (`RangeError`: ask for `top_m >= K`). */
  topIds(k: number): Int32Array {
    if (this.dense !== null) return topKIds(this.dense, k);
    if (this.ids.length < k) {
      throw new RangeError(`the sparse distribution holds ${this.ids.length} ids, fewer than K = ${k}: use top_m >= K`);
    }
    return Int32Array.from(this.ids.subarray(0, k));
  }

  /** The cloud's own most likely token (`argmax`, ties to the lower id). */
  topId(): number {
    return this.topIds(1)[0];
  }
}

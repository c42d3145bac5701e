/**
 * The cloud's next-token row for one step as the edge reads it (Python: `edge_sdk.protocol.wire.CloudDistribution`):
 * sparse (exact `values` at `ids`, by decreasing value; every omitted entry at most `tailBound`, together
 * `tailMass`) or full (`dense`).  The edge decides from a sparse row with every omitted id at the public fill,
 * computed from what the cloud sent alone.
 */

import { InvalidArgumentError } from "./errors.js";
import { type FusionSpace, lowestOf, sumFloat64, topKIds } from "./fusion.js";

export class CloudDistribution {
  constructor(
    readonly step: number,
    readonly ids: Int32Array = new Int32Array(0),
    readonly values: Float32Array = new Float32Array(0),
    readonly tailBound = 0,
    readonly tailMass = 0,
    readonly dense: Float32Array | null = null,
  ) {
    if (ids.length !== values.length) {
      throw new InvalidArgumentError(`a sparse row has ${ids.length} ids but ${values.length} values`);
    }
  }

  /** A full row. */
  static full(step: number, dense: Float32Array): CloudDistribution {
    return new CloudDistribution(step, new Int32Array(0), new Float32Array(0), 0, 0, dense);
  }

  get isFull(): boolean {
    return this.dense !== null;
  }

  /** A dense row exact where known and `fill` where omitted (the full row itself when dense). */
  lowerDense(vocabSize: number, fill = 0): Float32Array {
    if (this.dense !== null) return this.dense;
    const out = new Float32Array(vocabSize).fill(fill);
    for (let j = 0; j < this.ids.length; j++) out[this.ids[j]] = this.values[j];
    return out;
  }

  /**
   * The value a sparse row's omitted ids stand at when the edge decides from it: the omitted mass shared evenly,
   * at most the tail bound `b`:
   *
   *     prob:   fill = min(b, tailMass / nOmitted)
   *     logit:  fill = min(b, log(tailMass / nOmitted) + log Z),   log Z = logsumexp(sent) - log(1 - tailMass)
   *
   * A row that lists every id has no fill; a tail mass of 0 fills with the space's lowest value.
   */
  publicFill(vocabSize: number, space: FusionSpace): number {
    const omitted = vocabSize - this.ids.length;
    const lowest = lowestOf(space);
    if (this.dense !== null || omitted <= 0 || this.tailMass <= 0) return lowest;
    const share = this.tailMass / omitted;
    if (space === "prob") return Math.min(this.tailBound, share);
    if (!(this.tailMass < 1.0) || this.values.length === 0) return this.tailBound;
    let top = -Infinity;
    for (const value of this.values) if (value > top) top = value;
    const shifted = Array.from(this.values, (value) => Math.exp(value - top));
    const logZ = top + Math.log(sumFloat64(shifted)) - Math.log1p(-this.tailMass);
    return Math.min(this.tailBound, Math.log(share) + logZ);
  }

  /** The row exact where sent and at the public fill where omitted. */
  filled(vocabSize: number, space: FusionSpace): Float32Array {
    return this.lowerDense(vocabSize, this.publicFill(vocabSize, space));
  }

  /** `TopK` of the cloud's row; a sparse row must hold at least `k` ids. */
  topIds(k: number): number[] {
    if (this.dense !== null) return topKIds(this.dense, k);
    if (this.ids.length < k) {
      throw new InvalidArgumentError(
        `the sparse distribution holds ${this.ids.length} ids, fewer than K = ${k}: use top_m >= K`,
      );
    }
    return Array.from(this.ids.subarray(0, k));
  }

  /** The cloud's own most likely token. */
  topId(): number {
    return this.topIds(1)[0];
  }
}
